"""Probe: which forward solutions/attention_op's launch plans pick on an sm_90 GPU, and the GPU
times the plan compared (stage 4's wgmma kernel against the Triton forward of the plan's set).

    python grader/bench/probes/op_forward_plans.py [--json PATH]

One row per case: the stage 9 bench's forward cases (grader/bench/cases.py), the gpt-oss layer
(B1 N4096 Hq64/Hkv8 D64, learned sinks, full causal and window 128) and head dims that are not
powers of two (stage 9's kernels are the Triton set there).  ``forward_ms`` is what the plan
measured (plans._gpu_ms: the calls queued behind a spin of the GPU, so only kernel time counts);
the plan keeps the faster.  ``summary`` makes the table docs/hopper-notes.md (section 11) shows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_package  # noqa: E402


def cases() -> list[dict]:
    from grader.bench.cases import CASES
    rows = [dict(name=c.name, b=c.batch, hq=c.heads, hkv=c.hkv, n=c.n_q, d=c.head_dim, causal=c.causal,
                 window=c.window or 0, sinks=c.sinks) for c in CASES["stage9"] if not c.backward]
    rows += [dict(name=f"gpt-oss B1 N4096 Hq64/Hkv8 D64 sinks, {'window 128' if w else 'full causal'}", b=1, hq=64,
                  hkv=8, n=4096, d=64, causal=True, window=w, sinks=True) for w in (0, 128)]
    rows += [dict(name=f"B4 H16 N4096 D{d} causal", b=4, hq=16, hkv=16, n=4096, d=d, causal=True, window=0,
                  sinks=False) for d in (80, 96)]
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Markdown rows: case, the Triton forward's set and ms, the wgmma forward's ms, their ratio, the pick."""
    lines = []
    for r in rows:
        (other, other_ms), = ((k, v) for k, v in r["forward_ms"].items() if k != "wgmma")
        wgmma_ms = r["forward_ms"]["wgmma"]
        name = "TMA" if other == "tma" else "stage 9"
        lines.append(f"| {r['case']} | {name} {other_ms:.3f} | {wgmma_ms:.3f} | {other_ms / wgmma_ms:.2f}x | "
                     f"{'wgmma' if r['wgmma'] else name} |")
    return lines


def main() -> int:
    import torch
    import triton
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "op-forward-plans.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a GPU of compute capability 9.0 (H100, H200)", file=sys.stderr)
        return 2
    op = load_package(ROOT / "solutions" / "attention_op")
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    device = torch.device("cuda", torch.cuda.current_device())
    for c in cases():
        started = time.monotonic()
        plan = op.launch_plan(c["b"], c["hq"], c["hkv"], c["n"], c["n"], c["d"], torch.bfloat16, device, c["causal"],
                              c["window"], 0, c["sinks"])
        row = dict(case=c["name"], wgmma=list(plan["wgmma"]) if plan["wgmma"] else None,
                   forward_ms=plan["forward_ms"], tma=plan["tma"], plan_s=round(time.monotonic() - started, 1))
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}")
    print("| case | Triton forward ms | wgmma ms | wgmma vs Triton | plan |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
