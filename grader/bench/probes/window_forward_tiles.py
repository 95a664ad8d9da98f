"""Probe: which tiles suit the TMA forward under a sliding window, beside FlexAttention?

Under a window the op's forward is the TMA forward (solutions/fast_forward_tma.py) with GQA heads
packed, its tile picked by the autotuner from ``TMA_TILES``. At window 128 each program does
little work (a 128-row tile of 4 heads x 32 positions sees about 160 keys), so a program's fixed
costs (its descriptors, q's load, o's store) weigh more than at long windows; taller tiles, with
more positions a program, are the lever this probe times. Every tile runs at stage 7's and 8's
gpt-oss-sized cases (B4 Hq32/Hkv8 N8192 D64, windows of 128 and 1024 keys, with and without
learned sinks), beside the autotuner's pick and FlexAttention compiled, in the same run. Each
tile is first checked against the float64 reference's judge at B1 Hq8/Hkv2 N2048.

    python grader/bench/probes/window_forward_tiles.py [--json FILE]      (a Hopper GPU)

docs/hopper-notes.md says what it measured.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_file  # noqa: E402

import torch  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M rows are 4 packed heads x BLOCK_M / 4 positions
TILES = [(128, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
         (256, 64, 8, 2), (256, 64, 8, 3), (256, 32, 8, 3), (256, 128, 8, 2), (256, 64, 16, 2), (512, 64, 16, 2)]
#: --narrow: the narrow key blocks that won at window 128 in the first run, and their neighbours
NARROW = [(128, 32, 4, 3), (128, 32, 4, 2), (128, 32, 4, 4), (128, 32, 8, 3), (128, 16, 4, 3), (128, 16, 4, 4),
          (64, 16, 4, 3), (64, 32, 4, 3), (64, 32, 4, 4), (256, 16, 8, 3), (256, 32, 8, 4)]
#: --one-loop: tiles timed with a window's blocks in one masked loop against two loops
ONE_LOOP = [(128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3)]


def summary(rows: list[dict]) -> list[str]:
    """Per run and case: FlexAttention's ms, the autotuned TMA forward's, and the fastest tile's, with
    ratios (rows without a ``run`` are one run)."""
    lines = ["| run | case | FlexAttention ms | TMA, autotuned ms (tile) | TMA, fastest tile ms (tile) | "
             "autotuned vs flex | fastest vs flex |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for run, case in dict.fromkeys((r.get("run", "-"), r["case"]) for r in rows if r["provider"] == "tma tile"):
        of = [r for r in rows if (r.get("run", "-"), r["case"]) == (run, case) and r.get("ms")]
        flex = next((r["ms"] for r in of if r["provider"] == "flex"), None)
        tuned = next(r for r in of if r["provider"] == "tma autotuned")
        best = min((r for r in of if r["provider"] == "tma tile"), key=lambda r: r["ms"])
        ratio = (lambda ms: f"{flex / ms:.2f}x") if flex else (lambda ms: "-")
        lines.append(f"| {run} | {case} | {flex or 0:.3f} | {tuned['ms']:.3f} ({tuned['tile']}) | {best['ms']:.3f} "
                     f"({best['tile']}) | {ratio(tuned['ms'])} | {ratio(best['ms'])} |")
    return lines


def one_loop_summary(rows: list[dict]) -> list[str]:
    """Per case and tile of the --one-loop run: the forward with a window's blocks in two loops and
    in one masked loop, and the one loop's speed against the two."""
    lines = ["| case | tile | two loops ms | one loop ms | one loop's speed |", "| --- | --- | --- | --- | --- |"]
    ms = {(r["case"], r["tile"], r["provider"]): r["ms"] for r in rows if r.get("ms")}
    for case, tile in dict.fromkeys((c, t) for c, t, p in ms if p == "tma tile, one loop"):
        two, one = ms[case, tile, "tma tile, two loops"], ms[case, tile, "tma tile, one loop"]
        lines.append(f"| {case} | {tile} | {two:.4f} | {one:.4f} | {two / one:.2f}x |")
    return lines


def main():
    from triton.testing import do_bench
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "window-forward-tiles.json"))
    parser.add_argument("--narrow", action="store_true", help="time NARROW at window 128 only")
    parser.add_argument("--one-loop", action="store_true",
                        help="time ONE_LOOP's tiles with a window's blocks in one masked loop and in two")
    args = parser.parse_args()
    tiles, windows = (NARROW, (128,)) if args.narrow else (TILES, (128, 1024))
    run = "narrow" if args.narrow else "all tiles"
    loops = [None]                                                 # the forward's own rule
    if args.one_loop:
        tiles, run, loops = ONE_LOOP, "one loop", [0, "window"]     # two loops; one loop
    tma = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
    from test_fast_forward import _check
    from warp_specialized_dense import save_rows

    from grader.bench.cases import Case, Inputs
    from grader.bench.providers import Flex
    table = dict(tma.TMA_TILES)
    rows = []
    B, Hq, Hkv, N, D = 4, 32, 8, 8192, 64
    for window in windows:
        for with_sinks in (False, True):
            torch.manual_seed(0)
            q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            sinks = torch.randn(Hq, device="cuda") if with_sinks else None
            opts = dict(causal=True, window=window, sinks=sinks)
            case = f"B4 Hq32/Hkv8 N8192 D64 W{window}{' sinks' if with_sinks else ''}"
            small = [torch.randn(1, h, 2048, D, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
            small_opts = dict(opts, sinks=sinks[:8] if with_sinks else None)

            def bench(fn):
                return do_bench(fn, warmup=25, rep=200, return_mode="median")

            def record(provider, fn, tile=""):
                try:
                    _check(*fn(*small, **small_opts), *small, **small_opts)
                    ms = bench(lambda: fn(q, k, v, **opts))
                except Exception as err:                      # a probe reports and goes on
                    rows.append(dict(run=run, case=case, provider=provider, tile=tile, error=str(err)[:300]))
                    print(f"{case} {provider} {tile}: {type(err).__name__} {str(err)[:200]}", flush=True)
                    return
                rows.append(dict(run=run, case=case, provider=provider, tile=tile, ms=ms))
                print(f"{case} {provider} {tile}: {ms:.4f} ms", flush=True)

            tma.TMA_TILES = table
            tma.flash_attention(q, k, v, **opts)                         # the autotuner times its table
            picked = tma._tma_forward_kernel.best_config
            tile = f"{picked.kwargs['BLOCK_M']}/{picked.kwargs['BLOCK_N']}/{picked.num_warps}w/{picked.num_stages}s"
            record("tma autotuned", tma.flash_attention, tile)
            for bm, bn, warps, stages in tiles:
                tma.TMA_TILES = {64: [(bm, bn, warps, stages)]}         # the fixed tile's warps and stages
                for loop in loops:
                    most = window if loop == "window" else loop
                    name = "tma tile" if loop is None else f"tma tile, {'one loop' if most else 'two loops'}"
                    record(name, lambda *a, bm=bm, bn=bn, most=most, **o: tma.flash_attention(
                        *a, **o, block_m=bm, block_n=bn, one_loop_window=most), f"{bm}/{bn}/{warps}w/{stages}s")
            tma.TMA_TILES = table
            try:
                flex = Flex()
                shape = dict(batch=B, heads=Hq, kv_heads=Hkv, n_q=N, n_k=N, head_dim=D, causal=True, window=window,
                             sinks=with_sinks)
                attend = flex.attend(Case(**shape), Inputs(q, k, v, sinks, None))
                with torch.no_grad():
                    attend(q, k, v, sinks)
                    rows.append(dict(run=run, case=case, provider="flex", tile="",
                                     ms=bench(lambda: attend(q, k, v, sinks))))
                print(f"{case} flex: {rows[-1]['ms']:.4f} ms", flush=True)
            except Exception as err:                          # noqa: BLE001
                rows.append(dict(run=run, case=case, provider="flex", tile="", error=str(err)[:300]))
            save_rows(args.json, rows)
    print("\n".join(one_loop_summary(rows) if args.one_loop else summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
