"""Every kernel fits every GPU the workbook supports, proven without those GPUs.

* Triton: tests/tools/compile_targets.py compiles the kernels of stages 2, 3 and 5-9 for sm_75 (T4),
  sm_80 (A100), sm_86 and sm_89 (RTX 30/40, L4), sm_90 (H100) and sm_120 (RTX 50), one tile table
  per amount of shared memory, and each configuration must fit its target's shared memory.
* CUDA: nvcc builds stage 4's .cu for every architecture of cuda_build.ARCHS; sm_75 cannot build
  it (its mma, cp.async and bfloat16 need sm_80), and cuda_build refuses such a GPU with a message.
* Capability checks: bfloat16 on a GPU without it is refused with a message naming the GPU.

What is compiled, so that CI stays within a few minutes (compiles for sm_75 take about 10 s each,
others 1-3 s): stage 9's kernels stand for the forwards of stages 3 and 5-8 (its forward is stage
8's code, and all of them use one table).  On every target, each table row's first entry (the
tile used untimed) of stage 9's kernels in float16 and float32, and stage 2's kernels; on one
target per table (sm_75, sm_80, sm_86, sm_90) the whole float16 tables of stage 9's kernels and
the first entries of the other stages' forwards (on sm_75 at D=128 only).  sm_89 and sm_120 use
sm_86's table and shared memory.

tests/data/targets_smem.json keeps each compile's shared memory, keyed by everything that decides it
(Triton version, target, kernel source, signature, constants, options).  Every run compiles a core
(``always`` in compile_targets.py: stage 9's kernels at D=128 on every target, and every stage's
at D=128 on sm_80, sm_86 and sm_90) and whatever the file has no entry for, such as any kernel
whose source changed; the rest is read from the file.  WORKBOOK_TARGETS_FRESH=1 compiles
everything and rewrites the file.

That whole matrix runs only with WORKBOOK_COMPILE_MATRIX=all (a job of its own in CI: up to a quarter
of an hour of CPU when kernel sources changed).  By default a fixed sample is compiled instead
(``--sample`` in compile_targets.py): one configuration, the first planned, for every kernel of every
stage on every target the matrix compiles it for, so each kernel still meets each target; the tests
that need the whole tables or every head dim are skipped, saying so.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

from kernels import cuda_build, runtime, tuning
from kernels.loader import ROOT, load_stage

import pytest
import torch

HARNESS = ROOT / "tests" / "tools" / "compile_targets.py"
CACHE = ROOT / "tests" / "data" / "targets_smem.json"
CU = ROOT / "solutions" / "stage4_variable_block.cu"
CONFIG = {"HEAD_DIM": 72, "BLOCK_M": 64, "BLOCK_N": 32, "NUM_WARPS": 2}

needs_solutions = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="this copy has no solutions/")
FULL = os.environ.get("WORKBOOK_COMPILE_MATRIX") == "all" or os.environ.get("WORKBOOK_TARGETS_FRESH") == "1"
needs_full_matrix = pytest.mark.skipif(not FULL, reason="needs the whole compile matrix: WORKBOOK_COMPILE_MATRIX=all")
# The tests that read the matrix: CI's compile-matrix job runs these alone (-m compile_matrix), since the
# others do not depend on WORKBOOK_COMPILE_MATRIX and the quick run has run them already.
compile_matrix = pytest.mark.compile_matrix


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets") / "results.json"
    fresh = os.environ.get("WORKBOOK_TARGETS_FRESH") == "1"
    jobs = max(1, min(8, (os.cpu_count() or 2) // 2))
    cmd = [sys.executable, str(HARNESS), "--out", str(out), "--jobs", str(jobs)]
    if not FULL:
        cmd += ["--sample"]
    elif not fresh:
        cmd += ["--cache", str(CACHE)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    if fresh:
        CACHE.write_text(json.dumps({r["key"]: {"smem": r["smem"], "target": r["target"], "kernel": r["kernel"],
                                                "tile": r["tile"], "dtype": r["dtype"], "head_dim": r["head_dim"]}
                                     for r in results["rows"]}, indent=0, sort_keys=True) + "\n")
    return results


#: What does not fit, known and documented (docs/platforms.md): float32 at D=256 on a T4, whose 64 KB
#: do not hold dK/dV's smallest tile; the backward refuses it first (kernels.tuning.DOES_NOT_FIT).
KNOWN_LIMITS = {("sm_75", "float32", 256)}


@compile_matrix
@needs_solutions
def test_every_configuration_fits_its_target(matrix):
    rows = matrix["rows"]
    too_big = [f"{r['target']} {r['stage']} {r['kernel']} {r['dtype']} D{r['head_dim']} tile {r['tile']}: "
               f"{r['smem']} bytes of shared memory, the GPU has {r['limit']}" for r in rows
               if r["smem"] > r["limit"] and (r["target"], r["dtype"], r["head_dim"]) not in KNOWN_LIMITS]
    assert not too_big, "\n".join(too_big)


@compile_matrix
@needs_solutions
def test_the_sample_compiles_every_kernel_for_every_target_once(matrix):
    """Every (target, stage, kernel) the whole matrix compiles is in the run, whole or sampled; sampled, once."""
    pairs = [(r["target"], r["stage"], r["kernel"]) for r in matrix["rows"]]
    assert set(pairs) == {tuple(p) for p in matrix["pairs"]}
    assert {r["target"] for r in matrix["rows"]} == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120"}
    if matrix["sample"]:
        assert len(pairs) == len(set(pairs)) and all(r["how"] == "compiled" for r in matrix["rows"])


@compile_matrix
@needs_solutions
@needs_full_matrix
def test_the_known_limits_still_hold(matrix):
    rows = matrix["rows"]
    known = [r for r in rows if (r["target"], r["dtype"], r["head_dim"]) in KNOWN_LIMITS
             and r["kernel"] != "_bwd_preprocess_kernel"]
    assert known and any(r["smem"] > r["limit"] for r in known), \
        "a known limit no longer holds: drop it from KNOWN_LIMITS and docs/platforms.md"
    over = {r["kernel"] for r in known if r["smem"] > r["limit"] and r["tile"] == min(r2["tile"] for r2 in known
                                                                                   if r2["kernel"] == r["kernel"])}
    assert over <= {"_bwd_dkdv_kernel"}, f"these kernels' smallest tiles do not fit either: {over}"
    assert (64 * 1024, "float32", 256) in tuning.DOES_NOT_FIT, "the backward must refuse what does not fit"


@compile_matrix
@needs_solutions
@needs_full_matrix
def test_the_matrix_covers_every_target_kernel_and_head_dim(matrix):
    rows = matrix["rows"]
    targets = {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120"}
    assert {r["target"] for r in rows} == targets
    kernels = {(r["stage"], r["kernel"]) for r in rows}
    for stage in ("stage3", "stage5", "stage6", "stage7", "stage8", "stage9"):
        assert (stage, "_flash_forward_kernel") in kernels
    assert {("stage9", k) for k in ("_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")} <= kernels
    assert {("stage2", k) for k in ("_weighted_row_sum_kernel", "_softmax_kernel")} <= kernels
    for target in targets:
        for d in (64, 128, 256):
            for dtype in ("float16", "float32"):
                assert any(r["target"] == target and r["head_dim"] == d and r["dtype"] == dtype
                           and r["kernel"] == "_bwd_dq_kernel" for r in rows), (target, d, dtype)


@compile_matrix
@needs_solutions
@needs_full_matrix
def test_whole_tables_are_compiled_for_the_target_of_each_table(matrix):
    stage9 = load_stage("stage9", "solutions")
    tables = {"_flash_forward_kernel": tuning.FORWARD_TILES_BY_SMEM, "_bwd_dkdv_kernel": stage9.DKDV_TILES_BY_SMEM,
              "_bwd_dq_kernel": stage9.DQ_TILES_BY_SMEM}
    limits = {"sm_75": 64 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_90": 227 * 1024}
    for kernel, by_smem in tables.items():
        for target, limit in limits.items():
            table = tuning.for_smem(by_smem, limit)
            for d, entries in table.items():
                compiled = {tuple(r["tile"]) for r in matrix["rows"] if r["target"] == target and r["stage"] == "stage9"
                            and r["kernel"] == kernel and r["head_dim"] == d and r["dtype"] == "float16"}
                assert compiled >= set(entries), (kernel, target, d, set(entries) - compiled)


def test_every_test_that_reads_the_matrix_is_marked_for_its_job():
    """CI's compile-matrix job selects ``-m compile_matrix``: a test reading the matrix without the
    mark would never see the whole matrix."""
    import inspect
    reading = [f for name, f in globals().items() if name.startswith("test_") and callable(f)
               and "matrix" in inspect.signature(f).parameters]
    assert len(reading) == 5
    unmarked = [f.__name__ for f in reading
                if not any(m.name == "compile_matrix" for m in getattr(f, "pytestmark", []))]
    assert not unmarked, unmarked


def test_every_budget_has_a_row_for_every_head_dim():
    """Each budget's table covers the head dims the largest does, with well-formed tiles, down to a T4's 64 KB."""
    stage9 = load_stage("stage9", "solutions") if (ROOT / "solutions").is_dir() else None
    tables = [tuning.FORWARD_TILES_BY_SMEM] + ([stage9.DKDV_TILES_BY_SMEM, stage9.DQ_TILES_BY_SMEM] if stage9 else [])
    for by_smem in tables:
        assert min(by_smem) <= 64 * 1024, "a table for a T4's 64 KB"
        for budget, table in by_smem.items():
            assert set(table) == set(by_smem[max(by_smem)]), f"head dims differ at {budget} bytes"
            for d, entries in table.items():
                assert entries and len(set(entries)) == len(entries), (budget, d)
                for bm, bn, warps, stages in entries:
                    assert bm >= 16 and bn >= 16 and not bm & (bm - 1) and not bn & (bn - 1), (budget, d, bm, bn)
                    assert warps in (2, 4, 8) and 1 <= stages <= 5
                    if by_smem is tables[-1] and stage9:
                        assert bm % 8 == 0, "dQ packs up to 8 heads of a GQA group in one tile"


def test_for_smem_picks_the_largest_budget_that_fits():
    tables = {227 * 1024: "h100", 163 * 1024: "a100", 99 * 1024: "rtx", 64 * 1024: "t4"}
    assert tuning.for_smem(tables, 232448) == "h100"
    assert tuning.for_smem(tables, 166912) == "a100"
    assert tuning.for_smem(tables, 101376) == "rtx"
    assert tuning.for_smem(tables, 65536) == "t4"
    assert tuning.for_smem(tables, 48 * 1024) == "t4"       # smaller than every budget: the smallest table


# ---- stage 4's CUDA kernel ---------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(cuda_build.nvcc() is None, reason="needs nvcc (the CUDA toolkit); no GPU needed")


@pytest.mark.nvcc
@needs_nvcc
@needs_solutions
def test_stage4_builds_for_every_architecture():
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda arch: cuda_build.compile_only(CU, arch=arch, defines=CONFIG),
                                cuda_build.ARCHS + ("sm_75",)))
    for arch, result in zip(cuda_build.ARCHS, results):
        assert result.ok, f"{arch}: {result.output[-2000:]}"
    sm75 = results[-1]
    assert not sm75.ok and "requires .target sm_80" in sm75.output, "sm_75 cannot run it: the refusal must stay true"


def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_an_sm75_gpu_is_refused_for_the_cuda_kernel_with_a_message(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    with pytest.raises(RuntimeError, match=r"Tesla T4 is sm_75.*need sm_80 or newer.*emulation run"):
        cuda_build.check_device()
    _fake_gpu(monkeypatch, (12, 0), "NVIDIA GeForce RTX 5090")
    cuda_build.check_device()


def test_bfloat16_needs_sm80(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    assert not runtime.has_bfloat16()
    with pytest.raises(TypeError, match=r"q.dtype is torch.bfloat16.*Tesla T4 is sm_75.*torch.float16"):
        runtime.check_dtype(torch.bfloat16)
    runtime.check_dtype(torch.float16)
    _fake_gpu(monkeypatch, (8, 6), "NVIDIA GeForce RTX 3090")
    assert runtime.has_bfloat16()


def test_an_old_nvcc_is_refused_for_a_new_architecture(monkeypatch):
    monkeypatch.setattr(cuda_build, "nvcc_release", lambda: (12, 4))
    with pytest.raises(RuntimeError, match=r"nvcc 12.4 cannot compile for sm_120: it needs CUDA 12.8"):
        cuda_build.check_nvcc_for("sm_120")
    cuda_build.check_nvcc_for("sm_80")


# ---- the smaller GPUs' tiles compute the right thing ----------------------------------------------

def _new_tiles() -> list[tuple[str, int, int, int]]:
    """(table, head dim, BLOCK_M, BLOCK_N) of every tile the smaller GPUs' tables add to the H100's."""
    stage9 = load_stage("stage9", "solutions")
    found = set()
    for name, by_smem, h100 in (("forward", tuning.FORWARD_TILES_BY_SMEM, tuning.FORWARD_TILES_H100),
                                ("dkdv", stage9.DKDV_TILES_BY_SMEM, stage9.DKDV_TILES_H100),
                                ("dq", stage9.DQ_TILES_BY_SMEM, stage9.DQ_TILES_H100)):
        for table in by_smem.values():
            for d, entries in table.items():
                found |= {(name, d, bm, bn) for bm, bn, _, _ in entries if (bm, bn) not in
                          {(m, n) for m, n, _, _ in h100[d]}}
    return sorted(found)


_EXPECTED: dict = {}


def _inputs_and_expected(stage9, head_dim):
    """Inputs with every feature of stage 9 (GQA, causal, window, sink tokens, learned sinks), and the
    answer with the interpreter's default tiles (which the stage tests check against the reference)."""
    if head_dim not in _EXPECTED:
        gen = torch.Generator().manual_seed(head_dim)
        q = torch.randn(1, 4, 70, head_dim, generator=gen)
        k, v = (torch.randn(1, 2, 90, head_dim, generator=gen) for _ in range(2))
        do = torch.randn(1, 4, 70, head_dim, generator=gen)
        options = dict(causal=True, window=40, sink_tokens=3, sinks=torch.randn(4, generator=gen))
        o, lse = stage9.flash_attention(q, k, v, **options)
        grads = stage9.flash_attention_backward(q, k, v, o, lse, do, **options)
        _EXPECTED[head_dim] = (q, k, v, do, options), (o, lse, *grads)
    return _EXPECTED[head_dim]


@needs_solutions
@pytest.mark.skipif(runtime.ON_GPU, reason="runs the tiles in the interpreter; on a GPU the stage tests run them")
@pytest.mark.parametrize("table,head_dim,block_m,block_n", _new_tiles() if (ROOT / "solutions").is_dir() else [])
def test_new_tiles_give_the_same_answer_in_the_interpreter(monkeypatch, table, head_dim, block_m, block_n):
    """Each tile only a smaller GPU uses, run by Triton's interpreter against the default tile's answer."""
    stage9 = load_stage("stage9", "solutions")
    (q, k, v, do, options), expected = _inputs_and_expected(stage9, head_dim)
    tile = (block_m, block_n, 4, 1)
    if table == "forward":
        monkeypatch.setattr(tuning, "FORWARD_INTERPRETER_TILE", tile)
        got, names = stage9.flash_attention(q, k, v, **options), ("o", "lse")
    else:
        monkeypatch.setattr(stage9, "DKDV_INTERPRETER_TILE" if table == "dkdv" else "DQ_INTERPRETER_TILE", tile)
        got = stage9.flash_attention_backward(q, k, v, *expected[:2], do, **options)
        expected, names = expected[2:], ("dq", "dk", "dv", "dsinks")
    for name, a, b in zip(names, got, expected):
        assert not a.isnan().any(), f"{name}: NaN with {table} tile {block_m}x{block_n} at D{head_dim}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name} with {table} tile {block_m}x{block_n}")


def test_a_build_lock_left_by_a_dead_process_is_cleared_and_a_live_one_waited_for(tmp_path):
    """torch.utils.cpp_extension waits forever on a build folder's lock; a process killed while
    building leaves one behind.  A stale lock is removed; a fresh one is waited for until its
    builder removes it."""
    import threading
    import time
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cuda_build.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    copy = cuda_build.stable_source(tmp_path, "native.cpp", "int x;\n")
    assert not lock.exists() and copy.read_text() == "int x;\n"

    lock.touch()                                           # a build in progress, finished by another "process"
    builder = threading.Timer(0.3, lock.unlink)
    builder.start()
    cuda_build.clear_stale_lock(tmp_path)
    builder.join()
    assert not lock.exists()
    assert cuda_build.stable_source(tmp_path, "native.cpp", "int x;\n") == copy     # unchanged text, same copy


def test_a_library_another_process_is_still_writing_is_waited_for(tmp_path, monkeypatch):
    """Two processes loading one kernel (pytest -n): the second finds the library on disk while the
    first's build still holds the folder's lock, the linker half way through the file.  It waits
    for the lock to go before loading, instead of failing on a file too short."""
    import shutil
    import threading
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to make a shared library with")
    monkeypatch.setenv("WORKBOOK_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cu"
    source.write_text("// a stand-in: the library below is what a build would leave\n")
    library = cuda_build.library_path(source, source.read_text(), {"X": 1}, "sm_90a")
    library.parent.mkdir(parents=True)
    built = tmp_path / "built.so"
    c_file = tmp_path / "answer.c"
    c_file.write_text("int answer(void) { return 42; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", str(c_file), "-o", str(built)], check=True)
    lock = library.parent / "lock"
    lock.touch()
    library.write_bytes(built.read_bytes()[:100])              # the first process's linker, part way

    def finish():
        shutil.copyfile(built, library)
        lock.unlink()
    builder = threading.Timer(0.5, finish)
    builder.start()
    try:
        lib = cuda_build.load(source, defines={"X": 1}, arch="sm_90a")
    finally:
        builder.join()
    assert lib.answer() == 42
