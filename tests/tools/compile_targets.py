"""Compile the Triton kernels of every stage for a list of GPUs, with no GPU present.

    python tests/tools/compile_targets.py --out results.json [--targets sm_75,sm_90] [--cache FILE]
                                          [--jobs N] [--sample]

Triton compiles for a target named explicitly (``GPUTarget("cuda", 75, 32)``) without a driver.
This script runs each stage's wrapper on small CPU tensors with a stand-in driver and a cache hook
that records each launch (its signature, constants and pointer alignment) instead of compiling or
launching it.  Then, for each target, it compiles each recorded kernel once per tile of the table
that target would use (``kernels.tuning.for_smem``: tables are keyed by shared memory), through
Triton's code generation up to PTX (ptxas, the slowest step, only with ``--ptxas``), and writes
each configuration's shared memory beside the target's limit.

What it compiles (tests/test_targets.py says why): on every target, the first entry of each
table row (the tile used untimed) for stage 2's and stage 9's kernels, in float16 and, for stage
9, float32; whole tables of stage 9's kernels (its forward is stage 8's code, with the table of
stages 3 and 5-7) in float16 on one target per table; the forwards of stages 3 and 5-8 at
each table row's first entry on those targets (on sm_75, whose compiles are the slowest, at
D=128); and the TMA kernels (solutions/fast_*_tma.py) on sm_90, the one target
solutions/attention_op runs them on, at D=64 and D=128, their whole tables, in both forms: with
their descriptors made on the host (stage "tma", as eager calls and compiled graphs run them) and
made in the kernel (stage "tma-in-kernel", as compiled graphs run them where torch cannot carry
host descriptors into a graph).  A host-made descriptor is part of the kernel's signature, tile
shape included: each tile compiles with its own.  ``--cache FILE``
reuses the shared memory recorded for an identical compile (same
Triton version, target, kernel source, signature, constants and options), except for the jobs
marked ``always``, which compile on every run.

``--sample`` compiles a fixed part of that matrix, and all of it on every run: for each kernel of each
stage on each target it would compile for, one configuration, the first it plans (the smallest head
dim, float16, the first entry of its table row).  Every kernel meets every target, in a few minutes
of CPU; the whole matrix, with its tables and head dims, is for a separate job.

It must run in a process of its own: kernels.runtime turns on Triton's interpreter on a machine
without a GPU, and here the kernels must stay real ``@triton.jit`` functions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# The wrappers run on CPU tensors with a stand-in driver: any GPU is hidden, so that kernels.runtime
# and the plans see a machine without one, as this script (and traced_launches.py, which imports it)
# is written for, whatever runs it.  On an H200 a visible GPU changed traced_launches.py's tiles.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from kernels import runtime  # noqa: E402  (sets TRITON_INTERPRET without a GPU: undone just below)

if "triton" in sys.modules:
    raise SystemExit("compile_targets: triton was imported before the interpreter could be turned off; "
                     "run this file as a script")
os.environ.pop("TRITON_INTERPRET", None)

from kernels import tuning  # noqa: E402
from kernels.loader import load_stage  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import driver  # noqa: E402

#: Every target the workbook promises to fit: capability, shared memory one block may use (bytes).
TARGETS = {
    "sm_75": ((7, 5), 64 * 1024),       # T4 (Colab's free GPU), RTX 20
    "sm_80": ((8, 0), 163 * 1024),      # A100
    "sm_86": ((8, 6), 99 * 1024),       # RTX 30, A10, A40
    "sm_89": ((8, 9), 99 * 1024),       # RTX 40, L4, L40
    "sm_90": ((9, 0), 227 * 1024),      # H100, H200
    "sm_120": ((12, 0), 99 * 1024),     # RTX 50
}


class _RecordingDriver:
    """Enough of a driver for JITFunction.run to bind arguments; nothing is compiled or launched."""

    def __init__(self):
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def record_launches(source: str) -> list[dict]:
    """Run every stage's wrappers once per head-dim row and dtype; return the launches they asked for."""
    launches: list[dict] = []
    context: dict = {}

    def hook(*args, **kwargs):
        compile_info = kwargs["compile"]
        fn = kwargs["fn"].jit_function
        launches.append({**context, "source": source, "kernel": fn, "name": fn.__name__,
                         "signature": compile_info["signature"], "constants": dict(compile_info["constants"]),
                         "attrs": compile_info["configs"][0],
                         "num_warps": compile_info["num_warps"], "num_stages": compile_info["num_stages"]})
        return True                    # handled: skip compiling and launching

    knobs.runtime.jit_cache_hook = hook
    driver.set_active(_RecordingDriver())
    try:
        gen = torch.Generator().manual_seed(0)

        def rand(*shape, dtype):      # on the GPU where there is one: the wrappers check the device
            return torch.randn(*shape, generator=gen).to(device=runtime.DEVICE, dtype=dtype)

        stage2 = load_stage("stage2", source)
        context.update(stage="stage2", dtype="float16", table=None)
        x = rand(8, 5000, dtype=torch.float16)
        stage2.weighted_row_sum(x, rand(5000, dtype=torch.float16), block_n=1024)
        stage2.softmax(x, block_n=4096)
        forwards = {"stage3": {}, "stage5": {"causal": True}, "stage6": {"causal": True},
                    "stage7": {"causal": True, "window": 24},
                    "stage8": {"causal": True, "window": 24, "sink_tokens": 2}}
        stage9 = load_stage("stage9", source)
        for d in (64, 128, 256):                 # one head dim per table row
            for dtype in (torch.float16, torch.float32):
                context.update(dtype=str(dtype).removeprefix("torch."), head_dim=d)
                q = rand(1, 4, 40, d, dtype=dtype)
                kv = rand(1, 2, 40, d, dtype=dtype)
                for name, options in forwards.items():
                    context.update(stage=name, table="forward")
                    k = kv if name not in ("stage3", "stage5") else rand(1, 4, 40, d, dtype=dtype)
                    load_stage(name, source).flash_attention(q, k, k, **options)
                context.update(stage="stage9", table="forward")
                sinks = torch.zeros(4, device=runtime.DEVICE)
                o, lse = stage9.flash_attention(q, kv, kv, causal=True, window=24, sink_tokens=2, sinks=sinks)
                context.update(table="backward")
                stage9.flash_attention_backward(q, kv, kv, torch.zeros_like(q), torch.zeros_like(q[..., 0]).float(), q,
                                                causal=True, window=24, sink_tokens=2, sinks=sinks)
        tma = _tma_modules(source)
        for d in (64, 128) if tma else ():       # the TMA kernels, which solutions/attention_op runs on sm_90
            for host, stage in ((True, "tma"), (False, "tma-in-kernel")):
                context.update(stage=stage, table="tma", dtype="float16", head_dim=d)
                q, kv = rand(1, 4, 40, d, dtype=torch.float16), rand(1, 2, 40, d, dtype=torch.float16)
                sinks = torch.zeros(4, device=runtime.DEVICE)
                o, lse = tma[0].flash_attention(q, kv, kv, causal=True, window=24, sink_tokens=2, sinks=sinks,
                                                host_descriptors=host)
                tma[1].flash_attention_backward(q, kv, kv, torch.zeros_like(q), torch.zeros_like(q[..., 0]).float(),
                                                q, causal=True, window=24, sink_tokens=2, sinks=sinks,
                                                host_descriptors=host)
    finally:
        knobs.runtime.jit_cache_hook = None
        pass                           # the stand-in driver stays: there is no real one to go back to
    # The TMA backward runs stage 9's preprocess, compiled under stage 9 already.
    return [x for x in launches if not x["stage"].startswith("tma") or x["name"].startswith("_tma_")]


def _tma_modules(source: str):
    """The TMA forward and backward (instructors' files), or None where the source has none."""
    from kernels.loader import load_file, source_dir
    folder = source_dir(source)
    if not (folder / "fast_forward_tma.py").exists() or not (folder / "fast_backward_tma.py").exists():
        return None
    return load_file(folder / "fast_forward_tma.py"), load_file(folder / "fast_backward_tma.py")


def tables_for(launch: dict, smem: int, stage9) -> list[tuple[int, int, int, int]] | None:
    """The tiles a GPU with ``smem`` bytes per block would try for this launch (None: no table)."""
    d = launch["constants"][(launch["kernel"].arg_names.index("HEAD_DIM_PAD"),)] if launch["table"] else None
    if launch["table"] == "tma":                 # one table per kernel, for sm_90's shared memory
        forward, backward = _tma_modules(launch["source"])
        table = {"_tma_forward_kernel": forward.TMA_TILES, "_tma_dkdv_kernel": backward.DKDV_TILES,
                 "_tma_dq_kernel": backward.DQ_TILES}[launch["name"]]
    elif launch["table"] == "forward":
        table = tuning.for_smem(tuning.FORWARD_TILES_BY_SMEM, smem)
    elif launch["name"] == "_bwd_dkdv_kernel":
        table = tuning.for_smem(stage9.DKDV_TILES_BY_SMEM, smem)
    elif launch["name"] == "_bwd_dq_kernel":
        table = tuning.for_smem(stage9.DQ_TILES_BY_SMEM, smem)
    else:
        return None
    return tuning._entries(table, d)


#: The meta-parameter that sets a host-made descriptor's tile (its positions), by argument name.
_DESCRIPTOR_TILES = {"K": "BLOCK_N", "V": "BLOCK_N", "Q": "BLOCK_M", "DO": "BLOCK_M", "LSE": "BLOCK_M",
                     "DELTA": "BLOCK_M"}


def signature_for(launch: dict, tile: dict) -> dict:
    """The launch's signature with each host-made descriptor's tile set from ``tile`` (BLOCK_M,
    BLOCK_N), as the wrappers' autotuning hooks set it: ``tensordesc<fp16[1, 1, 32, 64]>`` for
    K with BLOCK_N = 32, ``tensordesc<fp32[1, 64]>`` for lse with BLOCK_M = 64."""
    import re
    signature = dict(launch["signature"])
    for name, kind in signature.items():
        size = tile.get(_DESCRIPTOR_TILES.get(name))
        if not (isinstance(kind, str) and kind.startswith("tensordesc") and size):
            continue
        dtype, dims, rest = re.fullmatch(r"tensordesc<([^\[]*)\[([^\]]*)\](.*)>", kind).groups()
        dims = [x.strip() for x in dims.split(",")]
        dims[-2 if len(dims) == 4 else -1] = str(size)
        signature[name] = f"tensordesc<{dtype}[{', '.join(dims)}]{rest}>"
    return signature


def _gpu_values(launch: dict) -> dict:
    """Constants the wrapper would pass on a GPU where it passes CPU-sized ones."""
    if launch["name"] == "_bwd_preprocess_kernel":
        return {"BLOCK_M": 128}          # PREPROCESS_BLOCK_M on a GPU (64 in the interpreter)
    if launch["name"] == "_weighted_row_sum_kernel":
        return {"BLOCK_M": 4}
    return {}


def _source(kernel) -> str:
    """The code that decides a compile: every @triton.jit function of the kernel's module (the kernel
    and the helpers it calls), not the rest of the file (editing a tile table changes no kernel)."""
    module = sys.modules[kernel.__module__]
    jitted = sorted((name, obj.src) for name, obj in vars(module).items()
                    if isinstance(obj, triton.runtime.JITFunction))
    jitted += [(name, obj.fn.src) for name, obj in vars(module).items() if isinstance(obj, triton.runtime.Autotuner)]
    return hashlib.sha256(repr(sorted(jitted)).encode()).hexdigest()


def _key(launch: dict, signature: dict, constants: dict, target: str, warps: int, stages: int) -> str:
    text = json.dumps([triton.__version__, target, _source(launch["kernel"]), signature,
                       sorted((str(k), repr(v)) for k, v in constants.items()),
                       sorted((str(k), repr(v)) for k, v in launch["attrs"].items()), warps, stages], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compile_one(launch: dict, signature: dict, constants: dict, cc: tuple[int, int], warps: int, stages: int) -> int:
    """Compile for ``cc`` and return the shared memory the kernel needs, in bytes."""
    src = ASTSource(fn=launch["kernel"], signature=signature, constexprs=constants, attrs=launch["attrs"])
    target = GPUTarget("cuda", cc[0] * 10 + cc[1], 32)
    compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    return int(compiled.metadata.shared)


def _skip_ptxas():
    """Stop Triton's pipeline at PTX: shared memory is known by then, and ptxas is the slowest step."""
    from triton.backends.nvidia.compiler import CUDABackend
    add_stages = CUDABackend.add_stages

    def without_cubin(self, stages, options, *args):
        add_stages(self, stages, options, *args)
        stages["cubin"] = lambda src, metadata: b""

    CUDABackend.add_stages = without_cubin


#: Targets whose table is compiled whole: one per table (sm_89 and sm_120 share sm_86's table and limit).
TABLE_TARGETS = ("sm_75", "sm_80", "sm_86", "sm_90")
#: Compiled on every run, whatever the cache holds: each target's stage 9 kernels (the forward is
#: stage 8's code) at D=128 in float16, and on three targets every stage's kernels at D=128.
ALWAYS_ALL_STAGES = ("sm_80", "sm_86", "sm_90")


def plan_jobs(launches: list[dict], targets: list[str], stage9) -> list[dict]:
    """Every (launch, tile, target) to compile, each marked ``always`` or not (see the module's doc)."""
    jobs, seen = [], set()
    for target in targets:
        cc, limit = TARGETS[target]
        for launch in launches:
            stage, dtype, d = launch["stage"], launch["dtype"], launch.get("head_dim")
            if dtype == "float32" and stage != "stage9":
                continue                  # float32: stage 9's kernels (its forward is stage 8's code)
            if stage.startswith("tma") and target != "sm_90":
                continue                  # the TMA kernels: where the op runs them
            if stage not in ("stage2", "stage9") and (target not in TABLE_TARGETS or target == "sm_75" and d != 128):
                continue                  # stages 3, 5-8: stage 9's forward stands for them (see the doc above)
            entries = tables_for(launch, limit, stage9)
            whole = (entries is not None and (stage == "stage9" or stage.startswith("tma")) and dtype == "float16"
                     and target in TABLE_TARGETS)
            entries = [(None, None, launch["num_warps"], launch["num_stages"])] if entries is None else \
                entries if whole else entries[:1]
            for i, (bm, bn, warps, stages) in enumerate(entries):
                constants = dict(launch["constants"])
                names = launch["kernel"].arg_names
                for name, value in {"BLOCK_M": bm, "BLOCK_N": bn, **_gpu_values(launch)}.items():
                    if value is not None:
                        constants[(names.index(name),)] = value
                signature = signature_for(launch, {"BLOCK_M": bm, "BLOCK_N": bn})
                key = _key(launch, signature, constants, target, warps, stages)
                if key in seen:
                    continue
                seen.add(key)
                always = i == 0 and dtype == "float16" and d in (128, None) and (
                    (stage == "stage9" and launch["table"] == "backward" or launch["name"] == "_flash_forward_kernel"
                     and stage == "stage9") or target in ALWAYS_ALL_STAGES or stage.startswith("tma"))
                jobs.append({"launch": launch, "signature": signature, "constants": constants, "target": target,
                             "cc": cc, "limit": limit,
                             "tile": [bm, bn, warps, stages], "key": key, "always": always})
    return jobs


def sample_jobs(jobs: list[dict]) -> list[dict]:
    """The first planned job of each (target, stage, kernel): one configuration per kernel and target."""
    first: dict[tuple, dict] = {}
    for job in jobs:
        first.setdefault(_pair(job), job)
    return [dict(job, always=True) for job in first.values()]


def _pair(job: dict) -> tuple[str, str, str]:
    return job["target"], job["launch"]["stage"], job["launch"]["name"]


_JOBS: list[dict] = []


def _compile_job(i: int) -> tuple[int, int, float]:
    job = _JOBS[i]
    t0 = time.monotonic()
    smem = compile_one(job["launch"], job["signature"], job["constants"], job["cc"], job["tile"][2], job["tile"][3])
    return i, smem, time.monotonic() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--source", default="solutions")
    parser.add_argument("--cache", help="JSON of earlier results: reused for identical compiles not marked always")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--ptxas", action="store_true", help="also assemble with ptxas")
    parser.add_argument("--sample", action="store_true",
                        help="compile one configuration per kernel and target, all of them (no cache)")
    args = parser.parse_args(argv)
    if not args.ptxas:
        _skip_ptxas()
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    stage9 = load_stage("stage9", args.source)
    started = time.monotonic()
    launches = record_launches(args.source)
    planned = plan_jobs(launches, args.targets.split(","), stage9)
    pairs = sorted({_pair(job) for job in planned})
    _JOBS[:] = sample_jobs(planned) if args.sample else planned
    todo = [i for i, job in enumerate(_JOBS) if job["always"] or job["key"] not in cache]
    results = {i: (cache[job["key"]]["smem"], "cached", 0.0) for i, job in enumerate(_JOBS) if i not in set(todo)}
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            for i, smem, seconds in pool.imap_unordered(_compile_job, todo):
                results[i] = (smem, "compiled", seconds)
    else:
        for i in todo:
            _, smem, seconds = _compile_job(i)
            results[i] = (smem, "compiled", seconds)
    rows = []
    for i, job in enumerate(_JOBS):
        smem, how, seconds = results[i]
        launch = job["launch"]
        rows.append({"key": job["key"], "target": job["target"], "limit": job["limit"], "stage": launch["stage"],
                     "kernel": launch["name"], "dtype": launch["dtype"], "head_dim": launch.get("head_dim"),
                     "tile": job["tile"], "smem": smem, "how": how, "always": job["always"],
                     "seconds": round(seconds, 2)})
    compiled = sum(r["how"] == "compiled" for r in rows)
    Path(args.out).write_text(json.dumps({"seconds": round(time.monotonic() - started, 1), "ptxas": args.ptxas,
                                          "triton": triton.__version__, "compiled": compiled, "sample": args.sample,
                                          "pairs": pairs, "rows": rows}, indent=1))
    print(f"{len(rows)} configurations, {compiled} compiled, {len(rows) - compiled} from the cache, "
          f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
