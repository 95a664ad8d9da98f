"""A short sweep in CI: the reference passes every check with room to spare on a few seeds.

``python -m grader sweep`` runs the long version (hundreds of seeds); docs/verdicts.md has its margins.
"""

import os

from kernels.loader import ROOT

import pytest

from grader import stages
from grader.testing.sweep import sweep

# The sweep grades the instructors' reference, so a learner's bundle (no solutions/) leaves this file out.
pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="no solutions/ here: nothing to sweep")


@pytest.fixture(autouse=True)
def _autotuning_put_back(monkeypatch):
    """A sweep turns autotuning off in its process (as a grading's workers have it); after each
    test the setting is what it was, for the tests that run next in this process."""
    from kernels import tuning
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, os.environ.get(tuning.AUTOTUNE_ENV, "1"))


MARGIN = 0.8     # the reference's error stays below 80 % of what a check allows


def _assert_margins(found):
    for m in found.values():
        assert not m.failures, f"the reference fails {m.check} on seeds {m.failures}"
        assert m.worst < MARGIN, (f"{m.check}: the reference uses {m.worst:.2f} of its tolerance on seed "
                                  f"{m.worst_seed} ({m.worst_what}); the rule leaves too little room")


def test_stage1_reference_has_margin_on_a_few_seeds():
    _assert_margins(sweep(stages.find("stage1"), range(3)))


def test_stage3_padded_head_dims_pass_the_seed_that_once_failed():
    # float32, D=200 padded to 256: PyTorch's own max error happened to be small on this seed
    found = sweep(stages.find("stage3"), [1835936174, 0, 1], only=["head_dims_padded"])
    _assert_margins(found)
    assert found["head_dims_padded"].runs == 3 and found["head_dims_padded"].worst > 0


def test_a_parallel_sweep_finds_what_a_serial_one_does():
    from grader.testing.sweep import sweep_parallel
    stage = stages.find("stage1")
    serial = sweep(stage, range(2), only=["attention_lse_and_scale", "softmax_float16"])
    parallel = sweep_parallel(stage, range(2), jobs=2, only=["attention_lse_and_scale", "softmax_float16"])
    assert list(parallel) == list(serial)
    for name, m in serial.items():
        assert (parallel[name].runs, parallel[name].worst, parallel[name].worst_seed) == (m.runs, m.worst, m.worst_seed)
        assert len(parallel[name].seconds) == len(m.seconds) == m.runs


def test_checks_that_call_the_graders_helpers_run_in_the_sweep():
    """Stage 9's checks call the learner's functions through grader/isolation/harness.py (``_harness=``), as
    the worker does; the sweep's in-process runner must too, or every such check fails on every seed."""
    from grader.testing.sweep import format_table
    found = sweep(stages.find("stage9"), [0], only=["mha_gradients", "saves_nothing_quadratic"])
    assert not any(m.failures for m in found.values()), format_table(stages.find("stage9"), found, 0)
    assert found["mha_gradients"].worst > 0


def test_a_failing_check_says_why_in_the_table():
    from grader.testing.sweep import format_table
    stage = stages.find("stage1")
    found = sweep(stage, [0], only=["attention_lse_and_scale"])
    found["attention_lse_and_scale"].add(7, [], "seed 7: o: max error 1.0 at (0, 0)")
    table = format_table(stage, found, 0)
    assert "attention_lse_and_scale seeds [7]" in table and "seed 7: o: max error 1.0 at (0, 0)" in table


def test_the_sweep_without_overflow_checks_computes_the_same_margins():
    """The sweep turns off the interpreter's int32 overflow checks for speed; they must change no number."""
    import dataclasses

    from kernels import runtime

    from grader.check import Ctx
    from grader.testing.sweep import InProcess, without_overflow_checks
    if not runtime.INTERPRET:
        pytest.skip("the overflow checks are the Triton interpreter's; a GPU build has none to turn off")
    stage = stages.find("stage7")
    runner = InProcess(stage)                       # turns them off
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    assert builder.options.sanitize_overflow is False
    check = {c.name: c for c in stage.checks()}["window_short_sequences"]

    def margins():
        ctx = Ctx(runner, 11, timeout=check.timeout)
        check.fn(ctx)
        return ctx.margins

    builder.options = dataclasses.replace(builder.options, sanitize_overflow=True)
    try:
        checked = margins()
        assert without_overflow_checks() and builder.options.sanitize_overflow is False
        assert margins() == checked and checked
    finally:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=True)


def test_a_check_that_draws_no_random_input_runs_once():
    """Plans, nvcc and argument errors see the same inputs on every seed; a sweep runs them once, and
    every check that draws from the seed's generator on every seed."""
    from grader.testing.sweep import format_table
    stage = stages.find("stage4")
    found = sweep(stage, [0, 1], only=["plan_head_dims", "emulation_causal"])
    assert (found["plan_head_dims"].runs, found["plan_head_dims"].draws_inputs) == (1, False)
    assert (found["emulation_causal"].runs, found["emulation_causal"].draws_inputs) == (2, True)
    table = format_table(stage, found, 1.0)
    assert "on 2 seed(s)" in table and "the same on every seed: run once" in table


def test_a_time_limit_stops_starting_seeds_and_the_json_says_which_ran(tmp_path, capsys, monkeypatch):
    import json
    import os
    import time

    from kernels import tuning

    from grader.testing import sweep as sweeping
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    stage, only = stages.find("stage1"), ["softmax_float16"]
    assert sweep(stage, range(5), only=only, deadline=time.time() - 1)["softmax_float16"].runs == 0
    assert sweep(stage, range(2), only=only, deadline=time.time() + 3600)["softmax_float16"].runs == 2
    out = tmp_path / "sweep.json"
    assert sweeping.main("stage1", seeds=2, first_seed=7, only=only, json_path=str(out), time_limit=3600) == 0
    written = json.loads(out.read_text())
    assert written["seeds"] == [7, 8, 2] and written["seeds_done"] == {"stage1": [7, 8]}
    times = written["stages"]["stage1"]["softmax_float16"]
    assert times["first_seconds"] > 0 and times["then_seconds"] > 0      # the first seed's and the others'
    table = capsys.readouterr().out
    assert "on 2 seed(s)" in table and "first s  then s" in table
    assert os.environ[tuning.AUTOTUNE_ENV] == "0", "the sweep must take the tiles a grading's workers take"


def test_sweeps_merge_into_one_record_and_one_table(tmp_path):
    import json
    import subprocess
    import sys

    from grader.testing import sweep as sweeping
    only = ["softmax_float16", "attention_bad_input"]
    for first in (0, 2):
        json_path = str(tmp_path / f"{first}.json")
        assert sweeping.main("stage1", seeds=2, first_seed=first, only=only, json_path=json_path) == 0
    parts = [json.loads((tmp_path / f"{first}.json").read_text()) for first in (0, 2)]
    merged = sweeping.merge(parts)
    assert merged["seeds_done"] == {"stage1": [0, 1, 2, 3]}
    m = merged["stages"]["stage1"]["softmax_float16"]
    assert m["runs"] == 4 and m["worst"] == max(p["stages"]["stage1"]["softmax_float16"]["worst"] for p in parts)
    with pytest.raises(ValueError, match="two records"):
        sweeping.merge([parts[0], parts[0]])
    with pytest.raises(ValueError, match="one device"):
        sweeping.merge([parts[0], dict(parts[1], device="GPU: another")])
    out = subprocess.run([sys.executable, "-m", "grader.testing.sweep", "--merge", str(tmp_path / "m.json"),
                          str(tmp_path / "0.json"), str(tmp_path / "2.json")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    gpu_only = " - |" if merged["device"].startswith("GPU") else ""          # stage 1 has no GPU-only check
    assert f"| 1 | 4 (0-3) | {m['worst']:.2f} (softmax_float16, {m['worst_seed']}) |{gpu_only} 0 |" in out.stdout
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(merged))


def test_the_committed_gpu_sweep_has_hundreds_of_seeds_per_stage_and_no_failure():
    import json
    record = json.loads((ROOT / "docs" / "sweep-gpu-h100.json").read_text())
    assert "H100" in record["device"]
    assert set(record["seeds_done"]) == {f"stage{n}" for n in range(1, 10)}
    for stage, seeds in record["seeds_done"].items():
        assert len(seeds) >= 400, stage
        assert not any(m["failures"] for m in record["stages"][stage].values()), stage
    from grader.testing.sweep import markdown
    table = markdown(record).split("\n", 2)[2]              # the rows, without the device line
    assert table in (ROOT / "docs" / "verdicts.md").read_text(), "docs/verdicts.md shows another table"
