"""Probe: the one-pass backward written for Hopper with wgmma and the TMA, against the TMA backward and cuDNN.

Sections 6 and 9 of docs/hopper-notes.md found the two-kernel Triton backward multiplying at
nearly cuDNN's rate but doing seven matrix products a tile to cuDNN's five, and two one-pass
Triton kernels slower still. ``solutions/fast_backward_wgmma.cu`` is the one pass written by
hand (its defaults, ``2x2-warp1-early``, are the fast path's): a producer warpgroup feeding Q,
dO, lse and delta through a TMA ring, two consumer warpgroups that own 64 keys each, dS shared
between them through shared memory for dQ, and dQ added into a float32 buffer that every key
block of a row shares: by the TMA's reduce-add from one or two buffers in shared memory a
warpgroup (``tma1``, ``tma2``), by vector atomics from the registers (``atomic``), or stored in
fragment order for a writer warp to add (``warp1``, ``warp2``). ``-early`` puts dQ's product
before dK's so that dQ is stored while dK runs; ``-prefetch`` issues each step's S^T in the step
before, right after that step's dP^T, so that it multiplies while P, dS and dQ are made (head dim
64 only: at 128 its registers spill); ``-order`` launches causal key blocks longest first and
starts dense ones at staggered query blocks.
Each variant runs through solutions/fast_backward_wgmma.py's ``flash_attention_backward``.
``--leave-out`` also times the first configuration built without dQ's additions, and without dQ
altogether: diagnostics whose gradients are wrong by design, to show what the additions cost.

Each case first checks dq, dk and dv against float32 SDPA (largest error over the largest
gradient); only a correct kernel is timed.  Times include stage 9's preprocess (delta), zeroing
the float32 dQ and converting it, beside solutions/fast_backward_tma.py's backward and SDPA's
cuDNN backward, every provider on the same inputs in the same run:

    python grader/bench/probes/wgmma_backward.py [--configs 2x2-warp1-early,2x2-tma2] [--leave-out] [--json PATH]
                                                                   (an sm_90 GPU and nvcc)

tests/test_fast_backward_wgmma.py compiles each kind of variant for sm_90a, which needs no GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels import cuda_build, masks, reference, runtime  # noqa: E402,F401  (decides TRITON_INTERPRET first)
from kernels.loader import ROOT, load_file  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

HERE = Path(__file__).resolve().parent
fast = load_file(ROOT / "solutions" / "fast_backward_wgmma.py")
CU_FILE = fast.CU_FILE
_fused = load_file(HERE / "fused_dq_backward.py")     # its inputs, float32 reference and error measure


DQ_MODES = {"atomic": 0, "tma": 1, "warp": 2}     # how dQ is added: BWD_DQ_TMA in solutions/fast_backward_wgmma.cu


def parse_config(text: str) -> tuple[int, int, int, int, int, int]:
    """'2x2-tma2' -> (stages 2, dQ by the consumers' TMA reduce-add 1, 2 buffers, early 0, order 0,
    prefetch 0); '2x3-atomic' -> (3, atomics 0, 0, 0, 0, 0); '2x2-warp1-early-order' -> (2, a writer
    warp 2, 1 buffer, dQ's product before dK's 1, blocks reordered 1, 0); '2x3-warp1-early-prefetch'
    -> (3, 2, 1, 1, 0, the next step's S^T issued a step ahead 1: head dim 64 only)."""
    found = re.fullmatch(r"2x([234])-(atomic|tma[12]|warp[12])(-early)?(-prefetch)?(-order)?", text)
    if not found:
        raise SystemExit(f"--configs: {text!r} is not 2xSTAGES-DQ[-early][-prefetch][-order], with STAGES 2, 3 "
                         "or 4 and DQ one of atomic, tma1, tma2, warp1, warp2")
    stages, dq, early, prefetch, order = found.groups()
    mode = DQ_MODES[dq.rstrip("12")]
    return int(stages), mode, int(dq[-1]) if mode else 0, int(bool(early)), int(bool(order)), int(bool(prefetch))


def head_dims(config: str) -> tuple[int, ...]:
    """The head dims a configuration builds for: a prefetching one's registers fit at 64 only."""
    return (64,) if parse_config(config)[5] else (64, 128)


def nvcc_command(d: int, config: str, leave_out: int = 0, bf16_only: bool = False) -> list[str]:
    """nvcc's command line for one head dim and configuration, less what it makes and where
    (``bf16_only``: without the float16 kernels, for compile tests)."""
    stages, dq_mode, buffers, early, _, prefetch = parse_config(config)      # the order is chosen per call
    return [cuda_build.nvcc(), "-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a",
            f"-I{ROOT / 'solutions'}", f"-DHEAD_DIM={d}", f"-DBWD_STAGES={stages}", f"-DBWD_DQ_TMA={dq_mode}",
            f"-DBWD_DQ_BUFFERS={max(buffers, 1)}", f"-DBWD_DQ_EARLY={early}", f"-DBWD_PREFETCH={prefetch}",
            f"-DBWD_LEAVE_OUT={leave_out}", f"-DBWD_BF16_ONLY={int(bf16_only)}", str(CU_FILE)]


def build(d: int, config: str, folder: Path, leave_out: int = 0, bf16_only: bool = False) -> ctypes.CDLL:
    """Compile the kernel for one head dim and configuration (ptxas's report printed); ``leave_out``
    1 or 2 builds a diagnostic without dQ's additions, or without its product too; ``bf16_only``
    leaves the float16 kernels out (the probe's runs check both dtypes, so they build both)."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"wgmma_backward_d{d}_{config}_l{leave_out}{'_bf16' if bf16_only else ''}.so"
    cmd = nvcc_command(d, config, leave_out, bf16_only) + ["-Xptxas", "-v", "--shared", "-Xcompiler", "-fPIC",
                                                "-cudart", "shared", "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError("nvcc failed:\n" + done.stderr[-3000:])
    print("\n".join(line for line in done.stderr.splitlines() if "warning" in line or "Used" in line)[:1500],
          flush=True)
    out = fast.prepare(ctypes.CDLL(str(lib)))
    out.ptxas = done.stderr            # what ptxas said of it: registers, spills, serialized products
    out.order = parse_config(config)[4]
    return out


def backward(lib, q, k, v, o, lse, do, causal, window=0, sink_tokens=0, sinks=None):
    """(dq, dk, dv) of one variant, from the forward's o and lse, through the fast path's wrapper."""
    return fast.flash_attention_backward(q, k, v, o, lse, do, causal=causal, window=window or None,
                                         sink_tokens=sink_tokens, sinks=sinks, order=lib.order, lib=lib)[:3]


# Small shapes with the features the dense cases leave out: (name, query heads, K/V heads, options).
FEATURE_CHECKS = [
    ("GQA 4/2 causal", 4, 2, dict(causal=True)),
    ("MQA 4/1", 4, 1, dict()),
    ("GQA 4/2 window 100, 4 sink tokens, learned sinks", 4, 2,
     dict(causal=True, window=100, sink_tokens=4, sinks=True)),
    ("GQA 4/2 window 200, learned sinks", 4, 2, dict(causal=True, window=200, sinks=True)),
]


def feature_cases():
    """``(name, (q, k, v, do), options, flops)`` of gpt-oss's attention, bfloat16 D64 with learned
    sinks, causal or under a 128-key window: B1 N4096 Hq64/Hkv8 and B4 N2048 Hq16/Hkv4.  FLOPs over
    the visible pairs (kernels.masks.count), five products: 2.5x the forward's."""
    for b, n, hq, hkv in ((1, 4096, 64, 8), (4, 2048, 16, 4)):
        for window in (None, 128):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, do = (torch.randn(b, hq, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            k, v = (torch.randn(b, hkv, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            sinks = torch.randn(hq, device="cuda", generator=gen)
            pairs = masks.count(masks.attention_mask(n, n, causal=True, window=window), n, n)
            name = f"B{b} N{n} Hq{hq}/Hkv{hkv} D64 sinks {'window ' + str(window) if window else 'causal'}"
            yield name, (q, k, v, do), dict(causal=True, window=window, sinks=sinks), 4 * b * hq * 64 * pairs * 5 // 2


def summary(rows: list[dict], against: str = "cudnn") -> list[str]:
    """A markdown table of one run's cases that ``against`` ran: a row a case, a column a provider
    (backward TFLOP/s, and in brackets the time's ratio to ``against``'s in the same run).  Rows
    of a committed run that the probe once named otherwise are read under their present names
    (``provider_now``)."""
    def name(r):
        return r.get("provider_now", r["provider"])
    timed = [r for r in rows if r["bwd_ms"]]
    cases = [c for c in dict.fromkeys(r["case"] for r in timed) if any(name(r) == against for r in timed
                                                                      if r["case"] == c)]
    timed = [r for r in timed if r["case"] in cases]
    providers = list(dict.fromkeys(name(r) for r in timed))
    providers = [against] + [p for p in providers if p != against]
    lines = ["| case | " + " | ".join(providers) + " |", "| --- |" + " --- |" * len(providers)]
    for case in cases:
        of = {name(r): r for r in timed if r["case"] == case}
        ratio = {p: f" ({of[against]['bwd_ms'] / of[p]['bwd_ms']:.2f}x)" for p in of if p != against}
        cells = [f"{of[p]['bwd_tflops']:.0f}{ratio.get(p, '')}" if p in of else "–" for p in providers]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "wgmma-backward.json"))
    parser.add_argument("--configs", default="2x2-warp1-early,2x2-warp1-early-order",
                        help="consumer warpgroups (2) x ring stages, then how dQ is added: tma1 or tma2 (the "
                        "consumers' TMA reduce-add from one or two buffers), warp1 or warp2 (a writer "
                        "warp's), or atomic; then -early for dQ's product before dK's, -order for causal key "
                        "blocks longest first and dense ones starting at staggered query blocks; comma-separated")
    parser.add_argument("--cases", default="dense", help="dense (B4 H16 N4096, D64 and D128, causal or not), "
                        "features (gpt-oss's shapes: GQA, learned sinks, causal or a 128-key window, against "
                        "the TMA backward), or both, comma-separated")
    parser.add_argument("--leave-out", action="store_true",
                        help="also time the first configuration without dQ's additions, and without dQ "
                        "(wrong by design)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    if not cases or set(cases) - {"dense", "features"}:
        raise SystemExit(f"--cases: {args.cases!r} is not dense, features or dense,features")

    runtime.tma_scratch()
    tma_f = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    tma_b = load_file(ROOT / "solutions" / "fast_backward_tma.py")
    folder = Path(os.environ.get("OUT", "/tmp")) / "wgmma-backward-build"
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               nvcc=".".join(map(str, cuda_build.nvcc_release() or ())), rows=[], checks=[])
    print(doc["gpu"], doc["torch"], "triton", doc["triton"], "nvcc", doc["nvcc"], flush=True)
    configs = args.configs.split(",")
    for c in configs:
        parse_config(c)
    wanted = [(d, c, 0) for c in configs for d in head_dims(c)]
    wanted += [(d, configs[0], n) for d in head_dims(configs[0]) for n in (1, 2) if args.leave_out]
    with ThreadPoolExecutor(max_workers=8) as pool:                # nvcc runs on one core each
        built = dict(zip(wanted, pool.map(lambda w: build(w[0], w[1], folder, leave_out=w[2]), wanted)))
    libs = {(d, c): lib for (d, c, n), lib in built.items() if not n}
    diagnostics = {(d, n): lib for (d, c, n), lib in built.items() if n}

    def save():
        Path(args.json).write_text(json.dumps(doc, indent=1))

    def recorder(name, flops):
        """``record(provider, ms, note)``: keeps (and prints) a row of case ``name``."""
        def record(provider, ms, note=""):
            row = dict(case=name, provider=provider, bwd_ms=ms, note=note,
                       bwd_tflops=round(flops / ms / 1e9, 1) if ms else None)
            doc["rows"].append(row)
            save()
            print(f"  {provider:13s} {ms or 0:7.3f} ms  {row['bwd_tflops']} TFLOP/s  {note}", flush=True)
        return record

    # Small shapes first, both dtypes: a wrong kernel stops here.
    ok = dict.fromkeys(libs, True)

    def check(d, fields, want, run):
        """``run(lib)``'s gradients against ``want`` for every configuration at head dim ``d``,
        kept as a check row with ``fields``; a configuration off by more than MAX_ERROR is not timed."""
        for c in (c for c in configs if (d, c) in libs):
            try:
                err, note = _fused._error(run(libs[d, c]), want), ""
            except Exception as e:               # a probe reports and goes on
                err, note = float("inf"), f"{type(e).__name__}: {str(e)[:300]}"
            doc["checks"].append(dict(d=d, config=c, **fields, error=err, note=note))
            save()
            print(f"check D{d} {c} {' '.join(map(str, fields.values()))}: error {err:.2e} {note}", flush=True)
            ok[d, c] &= err < _fused.MAX_ERROR
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(1)
                q, k, v, do = (torch.randn(2, 3, 384, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
                o, lse = tma_f.flash_attention(q, k, v, causal=causal)
                check(d, dict(dtype=str(dtype), causal=causal), _fused._reference(q, k, v, do, causal),
                      lambda lib: backward(lib, q, k, v, o, lse, do, causal))
    # Then GQA, windows, sink tokens and learned sinks, against the float64 reference.
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for name, hq, hkv, opts in FEATURE_CHECKS:
                gen = torch.Generator(device="cuda").manual_seed(2)
                q, do = (torch.randn(1, hq, 384, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
                k, v = (torch.randn(1, hkv, 384, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
                sinks = torch.randn(hq, device="cuda", generator=gen) if opts.get("sinks") else None
                mask = dict(causal=opts.get("causal", False), window=opts.get("window"),
                            sink_tokens=opts.get("sink_tokens", 0))
                o, lse = tma_f.flash_attention(q, k, v, sinks=sinks, **mask)
                check(d, dict(dtype=str(dtype), case=name),
                      reference.attention_grads(q, k, v, do, sinks=sinks, **mask)[1:4],
                      lambda lib: backward(lib, q, k, v, o, lse, do, mask["causal"], mask["window"] or 0,
                                           mask["sink_tokens"], sinks))

    # gpt-oss's cases first, then the dense ones.
    for name, (q, k, v, do), opts, flops in (feature_cases() if "features" in cases else ()):
        start = time.time()
        sinks = opts.pop("sinks")
        o, lse = tma_f.flash_attention(q, k, v, sinks=sinks, **opts)
        print(name, flush=True)
        theirs = tma_b.flash_attention_backward(q, k, v, o, lse, do, sinks=sinks, **opts)[:3]
        record = recorder(name, flops)
        for c in configs:
            if not ok[64, c]:
                record(f"wgmma-{c}", None, "not timed: wrong on the small checks")
                continue

            def run(lib=libs[64, c]):
                return backward(lib, q, k, v, o, lse, do, True, opts["window"] or 0, 0, sinks)
            err = _fused._error(run(), theirs)
            if err > _fused.MAX_ERROR:
                record(f"wgmma-{c}", None, f"WRONG, relative difference from the TMA backward {err:.2e}")
                continue
            record(f"wgmma-{c}", _fused.bench(run), f"difference from the TMA backward {err:.1e}")
        record("tma", _fused.bench(lambda: tma_b.flash_attention_backward(q, k, v, o, lse, do, sinks=sinks, **opts)))
        print(f"  ({time.time() - start:.0f} s)", flush=True)

    for d, causal, name, (q, k, v, do), flops in (_fused.dense_cases() if "dense" in cases else ()):
        start = time.time()
        o, lse = tma_f.flash_attention(q, k, v, causal=causal)
        want = _fused._reference(q, k, v, do, causal)
        record = recorder(name, flops)
        print(name, flush=True)
        for c in (c for c in configs if (d, c) in libs):
            if not ok[d, c]:
                record(f"wgmma-{c}", None, "not timed: wrong on the small checks")
                continue

            def run(lib=libs[d, c]):
                return backward(lib, q, k, v, o, lse, do, causal)
            err = _fused._error(run(), want)
            if err > _fused.MAX_ERROR:
                record(f"wgmma-{c}", None, f"WRONG, relative error {err:.2e}")
                continue
            record(f"wgmma-{c}", _fused.bench(run), f"error {err:.1e}")
        for n, what in ((1, "no dQ additions"), (2, "no dQ")):
            if (d, n) in diagnostics:
                def wrong(lib=diagnostics[d, n]):
                    return backward(lib, q, k, v, o, lse, do, causal)
                record(f"wgmma-leave-out-{n}", _fused.bench(wrong),
                       f"diagnostic, {what} (gradients wrong by design), configuration {configs[0]}")
        _fused.baselines(record, tma_b, q, k, v, o, lse, do, causal, want)
        print(f"  ({time.time() - start:.0f} s)", flush=True)

    print()
    print("\n".join(summary(doc["rows"])))
    if "features" in cases:
        print()
        print("\n".join(summary([r for r in doc["rows"] if "Hkv" in r["case"]], against="tma")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
