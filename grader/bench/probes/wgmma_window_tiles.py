"""Probe: which tiles suit the wgmma forward under a sliding window?

The wgmma forward's window plan (``WINDOW_TILES`` in solutions/fast_variable_block_wgmma.py) was
chosen by what compiles without spilling, not by time. This probe times it at stage 7's and 8's
gpt-oss-sized cases (B4 Hq32/Hkv8 N8192 D64, windows of 128 and 1024 keys, with learned sinks)
at several tiles, beside the TMA forward (what the op runs); each forward is first checked
against the float64 reference's judge at B1 Hq8/Hkv2 N2048 with the same options (the float64
reference of the timed size would not fit).

    python grader/bench/probes/wgmma_window_tiles.py [--json FILE]      (an sm_90 GPU and nvcc)

docs/hopper-notes.md says what it measured.
"""
import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_file  # noqa: E402

import torch  # noqa: E402

# (block_n, consumer warpgroups, stages, pingpong) timed at each window
TILES = [(128, 2, 2, True), (64, 2, 2, True), (64, 3, 2, True), (32, 2, 2, True), (64, 2, 3, True),
         (128, 2, 2, False), (64, 1, 2, False), (96, 2, 2, True)]


def summary(rows: list[dict]) -> list[str]:
    """Per case: the TMA forward's TFLOP/s, the window plan's, and the fastest tile's, each against
    the TMA forward's."""
    lines = ["| case | TMA forward | wgmma, planned tile | wgmma, fastest tile | its tile |",
             "| --- | --- | --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        of = [r for r in rows if r["case"] == case and "tflops" in r]
        tma = next(r["tflops"] for r in of if r["provider"] == "tma")
        planned = next(r["tflops"] for r in of if r["provider"] == "wgmma plan")
        best = max((r for r in of if r["provider"].startswith("wgmma ")), key=lambda r: r["tflops"])
        lines.append(f"| {case} | {tma:.0f} | {planned:.0f} ({planned / tma:.2f}x) | {best['tflops']:.0f} "
                     f"({best['tflops'] / tma:.2f}x) | {best['tile']} |")
    return lines


def main():
    from triton.testing import do_bench
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "wgmma-window-tiles.json"))
    args = parser.parse_args()
    wgmma = load_file(ROOT / "solutions" / "fast_variable_block_wgmma.py")
    tma = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
    from test_fast_forward import _check
    from warp_specialized_dense import save_rows
    planned = wgmma.plan(64, True, True)
    with ThreadPoolExecutor(8) as pool:                       # nvcc, once per tile, in parallel
        list(pool.map(lambda t: wgmma._kernel(64, *t), [planned] + TILES))
    rows = []
    for window in (128, 1024):
        torch.manual_seed(0)
        B, Hq, Hkv, N, D = 4, 32, 8, 8192, 64
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sinks = torch.randn(Hq, device="cuda")
        opts = dict(causal=True, window=window, sinks=sinks)
        case = f"B4 Hq32/Hkv8 N8192 D64 W{window} sinks"
        pairs = sum(min(i + 1, window) for i in range(N))
        flops = 4 * B * Hq * D * pairs

        small = [torch.randn(1, h, 2048, D, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
        small_opts = dict(opts, sinks=sinks[:8])

        def record(name, fn, tile=""):
            try:
                _check(*fn(*small, **small_opts), *small, **small_opts)
            except AssertionError as err:
                rows.append(dict(case=case, provider=name, tile=tile, error=str(err)[:300]))
                print(f"{case} {name}: WRONG", flush=True)
                return
            ms = do_bench(lambda: fn(q, k, v, **opts), rep=200, return_mode="median")
            rows.append(dict(case=case, provider=name, tile=tile, ms=ms, tflops=round(flops / ms / 1e9, 1)))
            print(f"{case} {name} {tile}: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)

        record("tma", tma.flash_attention)
        record("wgmma plan", wgmma.flash_attention, "/".join(map(str, planned)))
        for bn, wg, st, pp in TILES:
            tile = f"{bn}/{wg}wg/{st}s/{'pp' if pp else 'no pp'}"
            record(f"wgmma {tile}", lambda *a, bn=bn, wg=wg, st=st, pp=pp, **o: wgmma.flash_attention(
                *a, **o, block_n=bn, warpgroups=wg, stages=st, pingpong=pp), tile)
    save_rows(args.json, rows)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
