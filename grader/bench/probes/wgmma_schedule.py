"""Probe: the hand-written Hopper forward's issue schedule, beside cuDNN.

solutions/fast_variable_block_wgmma.cu overlaps one key block's softmax with the product of the
block before, inside each consumer warpgroup. This probe times it at the dense cases of the other
probes under compile-time switches of that schedule, each output checked against float32 SDPA
first:

* ``PINGPONG=1``: the consumer warpgroups take turns issuing their products (named barriers), so
  one warpgroup's softmax runs while another's products do, as FlashAttention-3 arranges it;
* ``EARLY_RESCALE=1``: the accumulator is rescaled while the block's S = Q K^T runs, before P V
  is issued, instead of after P V has finished.

``--old FILE`` times another copy of the kernel (the one before a change) at its planned tiles
in the same run. Kernels are built with nvcc into ``--build`` (or found there, built before).

    python grader/bench/probes/wgmma_schedule.py [--old FILE] [--build DIR] [--json FILE]
    python grader/bench/probes/wgmma_schedule.py --build-only --build DIR     (nvcc, no GPU)

docs/hopper-notes.md says what it measured.
"""
import argparse
import ctypes
import hashlib
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels import cuda_build  # noqa: E402
from kernels.loader import ROOT, load_file  # noqa: E402

NEW = ROOT / "solutions" / "fast_variable_block_wgmma.cu"

# (block_n, consumer warpgroups, stages) per head dim, each under PINGPONG 0 and 1; at D64 and
# D128 also under EARLY_RESCALE 0 and 1.  The tiles fit the registers (160 a thread with three
# consumer warpgroups, 240 with two) and the shared memory, by the head dim.
TILES = {48: [(128, 3, 2), (96, 3, 2), (128, 2, 2), (176, 2, 2), (192, 2, 2)],
         64: [(128, 3, 2), (96, 3, 2), (128, 2, 2), (176, 2, 2), (192, 2, 2)],
         72: [(128, 3, 2), (112, 3, 2), (96, 3, 2), (128, 2, 2), (176, 2, 2), (192, 2, 2)],
         96: [(112, 3, 2), (96, 3, 2), (80, 3, 2), (128, 2, 2), (160, 2, 2), (176, 2, 2)],
         128: [(96, 3, 2), (80, 3, 2), (64, 3, 2), (128, 2, 2), (144, 2, 2), (176, 2, 2)],
         160: [(64, 3, 2), (112, 2, 2), (96, 2, 2), (80, 2, 2)],
         256: [(64, 2, 2), (80, 2, 2), (48, 2, 2)]}
SCHEDULES = {64: [(0, 0), (0, 1), (1, 0), (1, 1)], 128: [(0, 0), (0, 1), (1, 0), (1, 1)]}   # (PINGPONG, EARLY_RESCALE)
OLD_TILES = {64: [(128, 3, 2)], 128: [(96, 3, 2), (80, 3, 2)]}


def parse_tiles(spec: str) -> dict[int, list[tuple[int, int, int]]]:
    """``--tiles``: "64=128x3x3,128x2x3;128=128x2x3", keys x consumer warpgroups x stages by head dim."""
    out = {}
    for part in spec.split(";"):
        d, tiles = part.split("=")
        out[int(d)] = [tuple(int(x) for x in t.split("x")) for t in tiles.split(",")]
    return out


def jobs(new: Path, old: Path | None, tiles_by_dim: dict | None = None,
         turns_only: bool = False) -> list[tuple[str, Path, dict]]:
    """(provider name, source, defines) of every kernel the probe times: TILES (or
    ``tiles_by_dim``) under each schedule (with ``turns_only``, PINGPONG=1 and no early rescale)."""
    out = []
    for d, tiles in (tiles_by_dim or TILES).items():
        for bn, wg, st in tiles:
            for pp, er in [(1, 0)] if turns_only else SCHEDULES.get(d, [(0, 0), (1, 0)]):
                out.append((f"new {bn}/{wg}wg/{st}s pp{pp} er{er}", new,
                            dict(HEAD_DIM=d, BLOCK_N=bn, WARPGROUPS=wg, STAGES=st, PINGPONG=pp, EARLY_RESCALE=er)))
    if old is not None:
        for d, tiles in OLD_TILES.items():
            for bn, wg, st in tiles:
                out.append((f"old {bn}/{wg}wg/{st}s", old, dict(HEAD_DIM=d, BLOCK_N=bn, WARPGROUPS=wg, STAGES=st)))
    return out


def build(source: Path, defines: dict, folder: Path) -> tuple[Path, str]:
    """nvcc ``source`` with ``defines`` into a shared library under ``folder`` (kept by content
    hash); returns its path and ptxas's notes on wgmma serialization and spills."""
    text = source.read_text()
    key = hashlib.sha256((text + repr(sorted(defines.items()))).encode()).hexdigest()[:16]
    lib, log = folder / f"{source.stem}_{key}.so", folder / f"{source.stem}_{key}.log"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [cuda_build.nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
               "-Xptxas", "-v", "-shared", "-Xcompiler", "-fPIC", *[f"-D{k}={v}" for k, v in defines.items()],
               str(source), "-o", str(lib)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed for {defines}:\n{done.stderr[-3000:]}")
        log.write_text(done.stderr)
    # The dense and causal instantiations only: a window's (WINDOW=true) has tiles of its own.
    lines = [line for name, said in cuda_build.ptxas_by_function(log.read_text()).items()
             if not name.endswith("Lb1ELb1EEEvNS_6ParamsE") for line in said]
    notes = sorted({line.split("(C7")[1][:3] for line in lines if "(C751" in line})
    spills = max((int(line.split("bytes stack frame, ")[1].split()[0]) for line in lines if "spill stores" in line),
                 default=0)
    return lib, ",".join("C7" + n for n in notes) + (f" spills {spills} B" if spills else "")


def summary(rows: list[dict]) -> list[str]:
    """Per case: cuDNN, the old kernel's best tile, the new kernel's best tile without turns and
    with them (EARLY_RESCALE off), and the best of every switch, each as TFLOP/s and against cuDNN."""
    lines = ["| case | cuDNN | old, best | new, no turns | new, turns | best of all | its tile and switches |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        of = [r for r in rows if r["case"] == case and "tflops" in r]
        cudnn = next((r["tflops"] for r in of if r["provider"] == "cudnn"), float("nan"))

        def best(keep):
            return max((r for r in of if keep(r["provider"])), key=lambda r: r["tflops"], default=None)

        def cell(r):
            return "–" if r is None else f"{r['tflops']:.0f} ({r['tflops'] / cudnn:.2f}x)"
        old = best(lambda p: p.startswith("old"))
        plain = best(lambda p: p.startswith("new") and p.endswith("pp0 er0"))
        turns = best(lambda p: p.startswith("new") and p.endswith("pp1 er0"))
        top = best(lambda p: p.startswith("new"))
        lines.append(f"| {case} | {cudnn:.0f} | {cell(old)} | {cell(plain)} | {cell(turns)} | {cell(top)} | "
                     f"{top['provider'].removeprefix('new ') if top else '–'} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=Path, default=NEW, help="the .cu timed under every switch (default: %(default)s)")
    parser.add_argument("--old", type=Path, help="another copy of the .cu, timed at its planned tiles")
    parser.add_argument("--build", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "wgmma-schedule")
    parser.add_argument("--build-only", action="store_true", help="build every kernel and stop (no GPU needed)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "wgmma-schedule.json"))
    parser.add_argument("--tiles", type=parse_tiles, help='other tiles, e.g. "64=128x3x3;128=128x2x3"; '
                        "timed with turns only, at those head dims only")
    args = parser.parse_args()
    todo = jobs(args.new, args.old, args.tiles, turns_only=args.tiles is not None)
    head_dims = set(args.tiles or TILES)
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        built = list(pool.map(lambda j: build(j[1], j[2], args.build), todo))
    for (name, _, defines), (_, notes) in zip(todo, built):
        if notes:
            print(f"D{defines['HEAD_DIM']} {name}: ptxas {notes}")
    if args.build_only:
        return 0

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from warp_specialized_dense import dense_cases, save_rows
    wgmma = load_file(ROOT / "solutions" / "fast_variable_block_wgmma.py")

    # The .cu's entry point before it took GQA, windows and sinks (an --old copy may have it).
    legacy_argtypes = [ctypes.c_void_p] * 5 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 5 + \
        [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

    def kernel(path, source):
        lib = ctypes.CDLL(str(path))
        legacy = "int kv_heads" not in source.read_text()
        lib.stage4w_forward.argtypes = legacy_argtypes if legacy else wgmma.ARGTYPES
        lib.stage4w_forward.restype = ctypes.c_int
        return lib, legacy

    libs = [kernel(path, source) for (path, _), (_, source, _) in zip(built, todo)]
    rows = []

    def cases():
        """dense_cases()'s four, then B4 H16 N4096 without a mask at the other head dims."""
        yield from (case for case in dense_cases() if case[0] in head_dims)
        for D in sorted(head_dims - {64, 128}):
            torch.manual_seed(0)
            q, k, v = (torch.randn(4, 16, 4096, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            yield D, False, (q, k, v), 4 * 4 * 16 * D * 4096 * 4096, torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float())

    for D, causal, (q, k, v), flops, ref in cases():
        case = f"B4 H16 N4096 D{D}" + (" causal" if causal else "")
        B, H, N, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
        strides = (ctypes.c_int64 * 12)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
        stream = torch.cuda.current_stream().cuda_stream

        def record(name, fn, notes=""):
            o.zero_()
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                rows.append(dict(case=case, provider=name, error=f"relative error {err:.1e} against float32 SDPA"))
                print(f"{case} {name}: WRONG ({err:.1e})", flush=True)
                return
            ms = do_bench(fn, rep=200, return_mode="median")
            rows.append(dict(case=case, provider=name, ms=ms, tflops=round(flops / ms / 1e9, 1), err=err,
                             ptxas=notes))
            print(f"{case} {name}: {flops / ms / 1e9:.0f} TFLOP/s (err {err:.1e}) {notes}", flush=True)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            record("cudnn", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        for (name, _, defines), (lib, legacy), (_, notes) in zip(todo, libs, built):
            if defines["HEAD_DIM"] != D:
                continue

            def run(lib=lib, legacy=legacy):
                shape = (B, H, N, N, D) if legacy else (B, H, H, N, N, D)
                options = (int(causal),) if legacy else (int(causal), 0, 0, None)
                err = lib.stage4w_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                          strides, *shape, 1.0 / math.sqrt(D), 1, *options, stream)
                if err:
                    raise RuntimeError(f"{name}: error {err}")
                return o
            record(name, run, notes)
    save_rows(args.json, rows)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
