"""python -m grader bench stageN: time a stage's kernel against PyTorch's attention on a GPU.

    python -m grader bench stage4                 the learner's stages/ file against the providers
    python -m grader bench stage4 --solutions     the reference solution instead
    python -m grader bench stage4 --json out.json rows {stage, case, provider, ms, tflops} as JSON

Providers, timed in the same run on the same inputs:

    solution        the stage's own flash_attention
    sdpa-flash      torch's scaled_dot_product_attention, FlashAttention-2 backend
    sdpa-cudnn      ... cuDNN backend
    flex            torch's flex_attention, compiled
    stage3-triton   stage 3's Triton kernel (head dims padded to a power of two)

Throughput is FlashAttention's FLOP count, ``4 * B * H * D * pairs`` with the real head dim and
``pairs`` the visible (query, key) pairs, over ``triton.testing.do_bench``'s median.  Before a
provider is timed its output is compared with the float64 reference on two heads (the
workbook's tolerance rule); a provider that fails it, or cannot run the case, is reported and
not timed.  Stages add their cases to ``CASES`` and, if they differ, ``PROVIDERS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from kernels import runtime  # noqa: F401  (before triton: decides TRITON_INTERPRET)

import torch


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs per (batch, head); causal is aligned bottom-right."""
        if not self.causal:
            return self.n_q * self.n_k
        offset = self.n_k - self.n_q
        return sum(min(self.n_k, max(0, i + offset + 1)) for i in range(self.n_q))

    @property
    def flops(self) -> int:
        return 4 * self.batch * self.heads * self.head_dim * self.pairs


CASES: dict[str, list[Case]] = {
    "stage4": [Case(f"B4 H16 N4096 D{d} bf16", 4, 16, 4096, 4096, d) for d in (48, 72, 96, 160)],
}
DEFAULT_PROVIDERS = ["solution", "sdpa-flash", "sdpa-cudnn", "flex"]
PROVIDERS: dict[str, list[str]] = {
    "stage4": ["solution", "stage3-triton", "sdpa-flash", "sdpa-cudnn"],
}


class NotApplicable(Exception):
    """This provider cannot run this case (a head dim it lacks, a feature it does not have)."""


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, case: Case):
        if case.causal and case.n_q != case.n_k:
            raise NotApplicable("SDPA aligns causal masks top-left; the workbook aligns them bottom-right")
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)

    def run(q, k, v, case: Case):
        block_mask = None
        if case.causal:
            offset = case.n_k - case.n_q
            block_mask = create_block_mask(lambda b, h, i, j: j <= i + offset, None, None, case.n_q, case.n_k)
        return compiled(q, k, v, block_mask=block_mask)
    return run


def _stage(name: str, source: str, *, stage_kwargs=True):
    from kernels.loader import load_stage
    module = load_stage(name, source)

    def run(q, k, v, case: Case):
        if case.causal and not stage_kwargs:
            raise NotApplicable(f"{name} has no causal option")
        kwargs = {"causal": True} if case.causal else {}
        return module.flash_attention(q, k, v, **kwargs)
    return run


def provider(name: str, stage: str, source: str):
    """A function ``(q, k, v, case) -> o or (o, lse)`` for the provider ``name``."""
    if name == "solution":
        return _stage(stage, source)
    if name == "stage3-triton":
        return _stage("stage3", source, stage_kwargs=False)
    if name == "sdpa-flash":
        return _sdpa("FLASH_ATTENTION")
    if name == "sdpa-cudnn":
        return _sdpa("CUDNN_ATTENTION")
    if name == "flex":
        return _flex()
    raise ValueError(f"unknown provider {name!r}; expected one of solution, stage3-triton, sdpa-flash, "
                     "sdpa-cudnn, flex")


_SLICE = (slice(0, 1), slice(0, 2))   # the heads re-checked against float64: batch 0, heads 0 and 1


def _references(q, k, v, case: Case):
    """float64 reference and PyTorch-in-the-input-dtype baseline for the checked heads."""
    from kernels import reference
    ref, _ = reference.attention(q[_SLICE], k[_SLICE], v[_SLICE], causal=case.causal)
    base, _ = reference.attention(q[_SLICE], k[_SLICE], v[_SLICE], causal=case.causal, compute_dtype=q.dtype)
    return ref, base


def _check(out, q, refs) -> str | None:
    """None if the checked heads of ``out`` pass the tolerance rule against float64, else why not."""
    from kernels import tolerance
    o = out[0] if isinstance(out, tuple) else out
    if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(q.shape):
        return f"returned {type(o).__name__} of shape {getattr(o, 'shape', None)}; expected {tuple(q.shape)}"
    report = tolerance.compare(o[_SLICE], *refs, name="o", dims=("b", "h", "i", "d"))
    return None if report.ok else report.message


def run(stage: str, *, source: str = "stages", providers: list[str] | None = None,
        cases: list[Case] | None = None, warmup: int = 25, rep: int = 100, log=print) -> list[dict]:
    """Time every provider on every case; returns rows {stage, case, provider, ms, tflops, note}."""
    from triton.testing import do_bench
    cases = cases if cases is not None else CASES.get(stage)
    if not cases:
        raise ValueError(f"no benchmark cases for {stage}; the stages with cases are: {', '.join(CASES)}")
    providers = providers or PROVIDERS.get(stage, DEFAULT_PROVIDERS)
    fns = {}
    for name in providers:
        try:
            fns[name] = provider(name, stage, source)
        except Exception as exc:  # noqa: BLE001 - a provider that cannot load is reported, not fatal
            fns[name] = exc
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in cases:
        q = torch.randn(case.batch, case.heads, case.n_q, case.head_dim, device="cuda", dtype=case.dtype, generator=gen)
        k = torch.randn(case.batch, case.heads, case.n_k, case.head_dim, device="cuda", dtype=case.dtype, generator=gen)
        v = torch.randn(case.batch, case.heads, case.n_k, case.head_dim, device="cuda", dtype=case.dtype, generator=gen)
        refs = _references(q, k, v, case)
        for name, fn in fns.items():
            row = {"stage": stage, "case": case.name, "provider": name, "ms": None, "tflops": None, "note": ""}
            try:
                if isinstance(fn, Exception):
                    raise fn
                problem = _check(fn(q, k, v, case), q, refs)
                if problem:
                    row["note"] = f"wrong: {problem}"
                else:
                    ms = do_bench(lambda: fn(q, k, v, case), warmup=warmup, rep=rep, return_mode="median")
                    row.update(ms=ms, tflops=case.flops / ms * 1e-9)
            except NotApplicable as exc:
                row["note"] = f"n/a: {exc}"
            except Exception as exc:  # noqa: BLE001 - one provider failing must not stop the run
                row["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
            log(_format_row(row), flush=True)
        del q, k, v, refs
        torch.cuda.empty_cache()
    return rows


def _format_row(row: dict) -> str:
    if row["ms"] is None:
        return f"  {row['case']:<24} {row['provider']:<14} {row['note']}"
    return f"  {row['case']:<24} {row['provider']:<14} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s"


def table(rows: list[dict]) -> str:
    """TFLOP/s of each provider per case, and the solution's speed relative to each other provider."""
    names = list(dict.fromkeys(r["provider"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    get = {(r["case"], r["provider"]): r for r in rows}
    others = [n for n in names if n != "solution"]
    head = f"{'case':<24}" + "".join(f"{n:>15}" for n in names)
    if "solution" in names:
        head += "".join(f"{'vs ' + n:>19}" for n in others)
    lines = ["useful TFLOP/s (FLOPs of the real head dim; median of do_bench)", head]
    for c in cases:
        line = f"{c:<24}"
        for n in names:
            r = get.get((c, n))
            line += f"{r['tflops']:15.1f}" if r and r["tflops"] else f"{'-':>15}"
        sol = get.get((c, "solution"))
        for n in others if "solution" in names else []:
            r = get.get((c, n))
            ok = sol and sol["tflops"] and r and r["tflops"]
            line += f"{sol['tflops'] / r['tflops']:18.2f}x" if ok else f"{'-':>19}"
        lines.append(line)
    notes = [f"  {r['case']} / {r['provider']}: {r['note']}" for r in rows if r["note"]]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", help=f"stage to benchmark: {', '.join(CASES)}")
    parser.add_argument("--solutions", action="store_true", help="time solutions/ instead of stages/")
    parser.add_argument("--providers", help="comma-separated providers (default: the stage's list)")
    parser.add_argument("--json", metavar="PATH", help="write the rows {stage, case, provider, ms, tflops} here")
    parser.add_argument("--rep", type=int, default=100, help="milliseconds of timed runs per measurement")
    args = parser.parse_args(argv)
    stage = args.stage.strip().lower()
    stage = stage if stage.startswith("stage") else f"stage{stage}"
    if stage not in CASES:
        print(f"no benchmark cases for {args.stage}; the stages with cases are: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not runtime.ON_GPU:
        print(f"python -m grader bench times kernels on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}); run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    source = "solutions" if args.solutions else "stages"
    print(f"benchmarking {stage} ({source}/) on {runtime.describe()}", flush=True)
    rows = run(stage, source=source, providers=args.providers.split(",") if args.providers else None, rep=args.rep)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in ("stage", "case", "provider", "ms", "tflops", "note")} for r in rows], f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
