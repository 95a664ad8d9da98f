"""Probe: variants of solutions/fast_forward_tma.py's forward at the dense bench shapes (B4 H16 N4096,
D64 and D128, causal or not, bf16), with SDPA's cuDNN and FlashAttention-2 backends timed in the same run.

    python grader/bench/probes/tma_forward_variants.py        (a CUDA GPU; writes $OUT or /tmp/fwd_explore.json)

Variants, each a rewritten copy of the file: ``tiles`` adds deeper pipelines and 128 x 128 tiles to the
autotuner's table; ``ws`` asks Triton to warp-specialize the main key loop (``tl.range(...,
warp_specialize=True)``); ``ws+tiles`` both. docs/hopper-notes.md says what they measured.
"""
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from kernels.loader import load_file

import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SRC = Path("solutions/fast_forward_tma.py").read_text()
SOL = str(Path("solutions").resolve())
SRC = SRC.replace('Path(__file__).resolve().parent / "stage9_backward.py"', f'Path({SOL!r}) / "stage9_backward.py"')
EXTRA64 = "(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (128, 64, 4, 5), (128, 128, 4, 4), (64, 64, 4, 5)"
EXTRA128 = "(128, 128, 8, 4), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 4, 2), (128, 32, 4, 4)"

def variant(name, ws=False, tiles=False):
    s = SRC
    if ws:
        s = s.replace("    for start_n in range(lo, hi, BLOCK_N):\n        acc, m_i, l_i = _tma_block(",
                      "    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):\n"
                      "        acc, m_i, l_i = _tma_block(")
        assert "warp_specialize=True" in s
    if tiles:
        s = s.replace("64: [(128, 64, 4, 3),", f"64: [(128, 64, 4, 3), {EXTRA64},", 1)
        s = s.replace("128: [(128, 64, 8, 2),", f"128: [(128, 64, 8, 2), {EXTRA128},", 1)
    p = Path(f"/tmp/fwd_{name}.py")
    p.write_text(s)
    return load_file(p)

VARIANTS = {"base": dict(), "tiles": dict(tiles=True), "ws": dict(ws=True), "ws+tiles": dict(ws=True, tiles=True)}
def main():
    out = os.environ.get("OUT", "/tmp")
    rows = []
    torch.manual_seed(0)
    for D in (64, 128):
        for causal in (False, True):
            B, H, N = 4, 16, 4096
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            pairs = N * (N + 1) / 2 if causal else N * N
            flops = 4 * B * H * D * pairs
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            res = {"D": D, "causal": causal}
            for be, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "fa2")):
                with sdpa_kernel(be):
                    ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                  warmup=50, rep=300, return_mode="median")
                res[name] = round(flops / ms / 1e9, 1)
            for vname, kw in VARIANTS.items():
                try:
                    t0 = time.time()
                    mod = variant(vname, **kw)
                    o, _ = mod.flash_attention(q, k, v, causal=causal)
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    ms = do_bench(lambda: mod.flash_attention(q, k, v, causal=causal),
                                  warmup=50, rep=300, return_mode="median")
                    cfg = str(mod._tma_forward_kernel.best_config)
                    res[vname] = round(flops / ms / 1e9, 1)
                    res[vname + "_err"] = round(err, 5)
                    res[vname + "_cfg"] = cfg
                    print(f"D{D} causal={causal} {vname}: {res[vname]} TFLOP/s err {err:.2e} cfg {cfg} "
                          f"({time.time()-t0:.0f}s)", flush=True)
                except Exception as e:
                    res[vname] = None
                    res[vname + "_fail"] = repr(e)[:300]
                    print(f"D{D} causal={causal} {vname}: FAILED {repr(e)[:300]}", flush=True)
                    traceback.print_exc(limit=2)
            rows.append(res)
            json.dump(rows, open(f"{out}/fwd_explore.json", "w"), indent=1)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print(f"{'case':<14}" + "".join(f"{c:>10}" for c in ["cudnn", "fa2", *VARIANTS]))
    for r in rows:
        print(f"D{r['D']}{' causal' if r['causal'] else '':<8}  "
              + "".join(f"{str(r.get(c)):>10}" for c in ["cudnn", "fa2", *VARIANTS]))


if __name__ == "__main__":
    main()
