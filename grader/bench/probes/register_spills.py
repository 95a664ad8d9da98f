"""Probe: how many registers each TMA kernel's tiles need on Hopper, and how much they spill, without a GPU.

Triton compiles for a named target without a driver.  This compiles the TMA forward, dK/dV and dQ
kernels (solutions/fast_forward_tma.py, fast_backward_tma.py), at every tile of their tables, for
sm_90a, dense and with the causal mask and a window, in bfloat16 with one query head per K/V head,
and assembles each with the ptxas that Triton ships, which reports the registers a thread uses and
the bytes it spills to local memory.  A tile that spills reads and writes those bytes on every
iteration that needs them: a cost the autotuner sees only as a slower tile.

    python grader/bench/probes/register_spills.py [--json PATH] [--kernels dkdv,dq,forward]

Run it with the Triton the GPU machine has: the register allocation changes between versions.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())
if __name__ == "__main__":
    from kernels import runtime  # noqa: F401  (sets TRITON_INTERPRET without a GPU: undone just below)
    if "triton" in sys.modules:
        raise SystemExit("register_spills: triton was imported before the interpreter could be turned off")
    os.environ.pop("TRITON_INTERPRET", None)

FLOAT32 = {"LSE", "DELTA", "SINKS"}               # the kernels' float32 pointers; the others are bf16
SIZES = {"B", "H", "H_Q", "H_KV", "GROUP", "N_Q", "N_K", "WINDOW", "SINK_TOKENS", "STAT_STRIDE"}


def _signature(kernel) -> tuple[dict, set]:
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("sm_scale", "qk_scale"):
            signature[name] = "fp32"
        elif name.startswith("stride_") or name in SIZES:
            signature[name] = "i32"
        else:
            signature[name] = "*fp32" if name in FLOAT32 else "*bf16"
    return signature, constexprs


def _ptxas() -> str:
    import triton
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(shipped) if shipped.exists() else "ptxas"


def measure(kernel, tile, head_dim: int, masked: bool) -> dict:
    """Compile one configuration for sm_90a; its shared memory, registers and spill stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs = _signature(kernel)
    bm, bn, warps, stages = tile
    constants = {name: False for name in constexprs}
    constants.update(CAUSAL=masked, HAS_WINDOW=masked, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM_PAD=head_dim, PACK=1)
    constants = {name: value for name, value in constants.items() if name in constexprs}
    pointers = [i for i, name in enumerate(kernel.arg_names) if signature[name].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        done = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True)
    registers = re.findall(r"Used (\d+) registers", done.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
    if done.returncode or not registers:
        raise RuntimeError(f"ptxas: {done.stderr[-500:]}")
    return dict(smem=int(compiled.metadata.shared), registers=int(registers[0]), spill_store_bytes=int(spills[0]))


def summary(rows: list[dict]) -> list[str]:
    """Markdown rows, one per (kernel, head dim): how many tiles spill (with either mask), and how much."""
    lines = ["| kernel | D | tiles that spill | spill stores, bytes a thread (the worse mask) | tiles that do not |",
             "| --- | --- | --- | --- | --- |"]
    groups: dict[tuple, dict] = {}
    for r in rows:
        if "spill_store_bytes" in r:
            tiles = groups.setdefault((r["kernel"], r["head_dim"]), {})
            tiles[tuple(r["tile"])] = max(tiles.get(tuple(r["tile"]), 0), r["spill_store_bytes"])
    for (kernel, head_dim), tiles in groups.items():
        spilling = [b for b in tiles.values() if b]
        clean = ", ".join(f"{m}x{n} {w}w{s}s" for (m, n, w, s), b in tiles.items() if not b) or "none"
        amount = f"{min(spilling)}-{max(spilling)}" if spilling else "0"
        lines.append(f"| {kernel} | {head_dim} | {len(spilling)} of {len(tiles)} | {amount} | {clean} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "register-spills.json"))
    parser.add_argument("--kernels", default="forward,dkdv,dq")
    args = parser.parse_args()
    from kernels.loader import ROOT, load_file

    import triton
    forward = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    backward = load_file(ROOT / "solutions" / "fast_backward_tma.py")
    kernels = {"forward": (forward._tma_forward_kernel.fn, forward.TMA_TILES),
               "dkdv": (backward._tma_dkdv_kernel.fn, backward.DKDV_TILES),
               "dq": (backward._tma_dq_kernel.fn, backward.DQ_TILES)}
    wanted = args.kernels.split(",")
    ptxas = subprocess.run([_ptxas(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    doc = dict(target="sm_90a", triton=triton.__version__, ptxas=ptxas, dtype="bfloat16", rows=[])
    print(doc["target"], "triton", doc["triton"], "ptxas", ptxas, flush=True)
    for name, (kernel, table) in kernels.items():
        if name not in wanted:
            continue
        for head_dim in (64, 128):
            for tile in table.get(head_dim, []):
                for masked in (False, True):
                    row = dict(kernel=name, head_dim=head_dim, tile=list(tile),
                               mask="causal, window" if masked else "none")
                    try:
                        row.update(measure(kernel, tile, head_dim, masked))
                    except Exception as e:          # a probe reports and goes on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    doc["rows"].append(row)
                    print(row, flush=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    errors = [r for r in doc["rows"] if "error" in r]
    print("", *summary(doc["rows"]), f"({len(errors)} configurations failed to compile)", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
