"""python -m grader doctor, and the grader on a platform without Triton.

The judgement is tested on described machines (a Mac, native Windows, a T4, a clashing ``kernels``
distribution, ...); the machine the test runs on is gathered for real; a missing Triton is simulated
in a subprocess by hiding it from Python's path finder, the way it is missing on macOS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

from kernels import runtime
from kernels.loader import ROOT

import pytest

from grader import doctor, stages

CPU_PINS = doctor.tested_versions("cpu")
CUDA_PINS = doctor.tested_versions("cuda")


def _linux_cpu(**changes) -> doctor.Facts:
    facts = doctor.Facts(
        platform="linux", machine="x86_64", python=(3, 11, 7), torch=CPU_PINS["torch"] + "+cpu", torch_cuda=None,
        triton=CPU_PINS["triton"], gpu=None, interpret_forced=False,
        owners={"kernels": ["flash-attention-workbook"], "grader": ["flash-attention-workbook"]},
        imported_from={"kernels": str(ROOT / "kernels"), "grader": str(ROOT / "grader")},
        cache_free={"/home/me/.triton/cache": 50 << 30}, nvcc="release 13.0")
    return replace(facts, **changes)


def _status(facts, topic) -> list[str]:
    return [f.status for f in doctor.findings(facts) if f.topic == topic]


def _rows(facts) -> dict[str, str]:
    return dict(doctor.stage_rows(facts))


T4 = doctor.GPU("Tesla T4", (7, 5), 64 * 1024)
H100 = doctor.GPU("NVIDIA H100 80GB HBM3", (9, 0), 227 * 1024)


def test_every_problem_comes_with_a_fix():
    machines = [_linux_cpu(), _linux_cpu(platform="darwin", machine="arm64", triton=None),
                _linux_cpu(platform="win32", triton=None), _linux_cpu(gpu=T4, torch_cuda="12.8"),
                _linux_cpu(torch="2.9.0", python=(3, 10, 12)), _linux_cpu(nvcc=None),
                _linux_cpu(cache_free={"/ro": None}), _linux_cpu(gpu=H100, torch_cuda=None)]
    for facts in machines:
        for f in doctor.findings(facts):
            assert f.status in ("ok", "note", "warn", "FAIL")
            assert f.status == "ok" or f.fix, f"{f.topic}: {f.detail} has no fix"


def test_the_tested_cpu_machine_is_all_ok():
    facts = _linux_cpu()
    bad = [f for f in doctor.findings(facts) if f.status in ("warn", "FAIL")]
    assert not bad, bad
    text, ok = doctor.report(facts)
    assert ok and "nothing blocks" in text


def test_mac_runs_only_the_stages_without_triton():
    facts = _linux_cpu(platform="darwin", machine="arm64", triton=None)
    assert _status(facts, "platform") == ["warn"]
    assert _status(facts, "triton") == ["warn"]           # missing by design there, not a broken install
    rows = _rows(facts)
    n = len(stages.find("stage1").checks())
    assert rows["stage1"] == f"{n} of {n} checks"
    for name in ("stage2", "stage3", "stage5", "stage6", "stage7", "stage8", "stage9"):
        assert rows[name].startswith("no: needs Triton"), (name, rows[name])
    assert not rows["stage4"].startswith("no"), "stage 4 (plan, emulation, nvcc) needs no Triton"
    text, ok = doctor.report(facts)
    assert ok and "dev container" in text and "docs/platforms.md" in text


def test_windows_cannot_grade_and_says_where_to_go():
    facts = _linux_cpu(platform="win32", triton=None)
    platform = [f for f in doctor.findings(facts) if f.topic == "platform"][0]
    assert platform.status == "FAIL" and "WSL2" in platform.fix
    assert all(text.startswith("no:") for text in _rows(facts).values())
    assert doctor.report(facts)[1] is False


def test_a_t4_has_no_bfloat16_and_no_stage4_kernel():
    facts = _linux_cpu(gpu=T4, torch_cuda="13.0", torch=CUDA_PINS["torch"] + "+cu130", triton=CUDA_PINS["triton"])
    found = {f.topic: f for f in doctor.findings(facts)}
    assert found["bfloat16"].status == "warn" and "sm_80" in found["bfloat16"].detail
    rows = _rows(facts)
    assert "need sm_80" in rows["stage4"] and "need sm_80" in rows["stage2"]   # bfloat16 checks
    h100 = _rows(_linux_cpu(gpu=H100, torch_cuda="13.0", torch="2.11.0+cu130", triton="3.6.0"))
    assert all("need" not in text for text in h100.values()), h100


def test_cpu_machine_counts_gpu_only_checks_as_not_run():
    rows = _rows(_linux_cpu())
    for stage in stages.STAGES:
        gpu_only = [c for c in stage.checks() if c.gpu]
        total = len(stage.checks())
        assert rows[stage.name].startswith(f"{total - len(gpu_only)} of {total} checks")


def test_versions_against_the_tested_sets_and_the_floor():
    assert _status(_linux_cpu(), "torch") == ["ok"]
    assert _status(_linux_cpu(torch="2.12.1+cpu"), "torch") == ["note"]       # works, not the tested pin
    assert _status(_linux_cpu(torch="2.9.0+cpu"), "torch") == ["FAIL"]        # older than the floor
    assert _status(_linux_cpu(triton="3.5.1"), "triton") == ["FAIL"]
    assert _status(_linux_cpu(triton=None), "triton") == ["FAIL"]             # Linux: a broken install
    gpu = _linux_cpu(gpu=H100, torch_cuda="13.0", torch="2.11.0+cu130", triton="3.6.0")
    assert _status(gpu, "torch") == ["ok"] and _status(gpu, "triton") == ["ok"]   # the CUDA set
    assert _status(replace(gpu, torch_cuda=None), "CUDA") == ["FAIL"]         # a CPU build beside a GPU
    assert _status(_linux_cpu(python=(3, 10, 12)), "python") == ["FAIL"]


def test_a_clashing_distribution_is_named_with_its_fix():
    clash = _linux_cpu(owners={"kernels": ["flash-attention-workbook", "kernels"], "grader": []})
    found = [f for f in doctor.findings(clash) if f.topic == "names"]
    assert [f.status for f in found] == ["warn"] and "pip uninstall kernels" in found[0].fix
    shadowed = _linux_cpu(imported_from={"kernels": "/venv/site-packages/kernels", "grader": str(ROOT / "grader")})
    found = [f for f in doctor.findings(shadowed) if f.topic == "names"]
    assert found[0].status == "FAIL" and "/venv/site-packages/kernels" in found[0].detail


def test_caches_without_room_or_unwritable():
    assert _status(_linux_cpu(cache_free={"/c": 100 << 20}), "caches") == ["warn"]
    assert _status(_linux_cpu(cache_free={"/c": None}), "caches") == ["FAIL"]


def test_interpreter_forced_on_a_gpu():
    facts = _linux_cpu(gpu=H100, torch_cuda="13.0", interpret_forced=True)
    assert [f.status for f in doctor.findings(facts) if f.topic == "interpreter"] == ["note"]


def test_smem_limits_of_the_tested_targets():
    assert doctor.smem_limit((7, 5)) == 64 * 1024 and doctor.smem_limit((8, 0)) == 163 * 1024
    assert doctor.smem_limit((8, 6)) == doctor.smem_limit((8, 9)) == doctor.smem_limit((12, 0)) == 99 * 1024
    assert doctor.smem_limit((9, 0)) == 227 * 1024


def test_gather_and_report_on_this_machine():
    facts = doctor.gather()
    assert facts.imported_from["kernels"] == str(ROOT / "kernels")
    assert facts.triton is not None and facts.platform == sys.platform
    result = subprocess.run([sys.executable, "-m", "grader", "doctor"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stages here:" in result.stdout and "platform" in result.stdout


# ---- a machine without Triton (as on macOS), simulated ----------------------------------------

HIDE_TRITON = textwrap.dedent("""
    import importlib.machinery
    _find = importlib.machinery.PathFinder.find_spec.__func__
    def _find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None          # as if no triton were on disk
        return _find(cls, name, path, target)
    importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
""")


@pytest.fixture
def no_triton(tmp_path):
    """Environment for a subprocess (and the grader's workers) that cannot find triton."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_TRITON)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(args, env, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_import_triton_without_triton_says_what_to_do(no_triton):
    # A probe (torch makes one when it starts CUDA) hears "not there"; an import hears what to do.
    code = ("from kernels import runtime; assert not runtime.HAS_TRITON\n"
            "import importlib.util; print('probe:', importlib.util.find_spec('triton'))\n"
            "try:\n    import triton\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    result = _run(["-c", code], no_triton)
    assert result.returncode == 0, result.stderr
    assert "probe: None" in result.stdout
    assert "No module named 'triton'" in result.stdout and "bash setup.sh" in result.stdout


def test_help_without_triton_names_the_supported_paths(monkeypatch):
    for platform in ("darwin", "win32"):
        monkeypatch.setattr(sys, "platform", platform)
        text = runtime.no_triton_help()
        for path in ("dev container", "WSL2", "Colab", "docs/platforms.md"):
            assert path in text
        assert "Stage 1" in text


def test_grader_without_triton_grades_stage1_and_explains_the_rest(no_triton):
    result = _run(["-m", "grader", "stage1,stage3", "--solutions"], no_triton)
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    assert out.index("Triton") < out.index("grading stage1"), "the note comes first"
    assert "stage3 needs Triton" in out
    score = re.search(r"score (\d+)/(\d+)", out)
    assert score and score.group(1) == score.group(2), out
    assert result.returncode == 0, out
    only_triton = _run(["-m", "grader", "stage3", "--solutions"], no_triton)
    assert only_triton.returncode == 2 and "stage3 needs Triton" in only_triton.stdout
    assert "Traceback" not in only_triton.stdout + only_triton.stderr


def test_doctor_without_triton(no_triton):
    result = _run(["-m", "grader", "doctor"], no_triton, timeout=300)
    assert result.returncode == 1, result.stdout      # on Linux a missing Triton is a broken install
    assert "triton is not installed" in result.stdout
    assert "stage3  no: needs Triton" in result.stdout
    n = len(stages.find("stage1").checks())
    assert f"stage1  {n} of {n} checks" in result.stdout


def test_guard_on_windows_and_without_triton(monkeypatch):
    said = []
    chosen = [stages.find("stage1"), stages.find("stage3"), stages.find("stage4")]
    monkeypatch.setattr(sys, "platform", "win32")
    assert doctor.guard(chosen, out=said.append) == (False, chosen)
    assert "WSL2" in said[-1] and "docs/platforms.md" in said[-1]
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(runtime, "HAS_TRITON", False)
    said.clear()
    go, kept = doctor.guard(chosen, out=said.append)
    assert go and [s.name for s in kept] == ["stage1", "stage4"]
    assert "Triton has no build for macOS" in said[0] and said[-1].startswith("stage3 needs Triton")
    assert doctor.guard(None, out=said.append) == (True, None)       # progress goes on, after the note
    monkeypatch.setattr(runtime, "HAS_TRITON", True)
    assert doctor.guard(chosen, out=said.append) == (True, chosen)
