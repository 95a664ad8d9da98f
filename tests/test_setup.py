"""What setup.sh installs where (grader/setup_plan.py), and the pins it installs with.

PyTorch's own wheel indexes may not be reachable where this runs, so the choice of build and index
is tested on described machines, with a faked ``nvidia-smi`` and a faked network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from kernels.loader import ROOT

import pytest

from grader import doctor, setup_plan
from grader.setup_plan import make_plan

UP = lambda url: True          # noqa: E731  (PyTorch's index answers)
DOWN = lambda url: False       # noqa: E731


def _plan(system="Linux", python=(3, 11), gpu=False, env=None, reachable=UP):
    return make_plan(system=system, python=python, gpu=gpu, env=env or {}, reachable=reachable)


def test_linux_without_a_gpu_gets_the_cpu_build_from_the_cpu_index():
    plan = _plan()
    assert plan.kind == "cpu" and not plan.stop
    assert plan.torch_args == [f"torch=={setup_plan.pin('cpu', 'torch')}", "--index-url", setup_plan.INDEX["cpu"]]
    assert plan.constraints == ROOT / "constraints" / "cpu.txt"


def test_linux_with_a_gpu_gets_the_cuda_build():
    plan = _plan(gpu=True)
    assert plan.kind == "cuda"
    assert plan.torch_args == [f"torch=={setup_plan.pin('cuda', 'torch')}", "--index-url", setup_plan.INDEX["cuda"]]


def test_an_unreachable_index_falls_back_to_the_default_and_says_so():
    plan = _plan(reachable=DOWN)
    assert plan.torch_args == [f"torch=={setup_plan.pin('cpu', 'torch')}"]
    assert any("cannot be reached" in note and "several GB" in note for note in plan.notes)


def test_overrides():
    assert _plan(gpu=True, env={"WORKBOOK_TORCH": "cpu"}).kind == "cpu"
    assert _plan(env={"WORKBOOK_TORCH": "cuda"}).kind == "cuda"
    assert _plan(env={"WORKBOOK_TORCH_INDEX": "pypi"}).torch_args == [f"torch=={setup_plan.pin('cpu', 'torch')}"]
    spec = _plan(env={"TORCH_SPEC": "torch==2.12.0"})
    assert spec.torch_args == ["torch==2.12.0"] and any("not the tested set" in n for n in spec.notes)
    assert _plan(env={"WORKBOOK_TORCH": "rocm"}).stop


def test_macos_uses_pypi_and_warns_about_triton_up_front():
    plan = _plan(system="Darwin", gpu=False)
    assert not plan.stop and plan.kind == "cpu" and "--index-url" not in plan.torch_args
    assert any("Triton has no macOS build" in n and "dev container" in n for n in plan.notes)


@pytest.mark.parametrize("system", ["MINGW64_NT-10.0-19045", "MSYS_NT-10.0", "CYGWIN_NT-10.0", "Windows"])
def test_windows_stops_and_points_at_wsl2(system):
    plan = _plan(system=system)
    assert "WSL2" in plan.stop and "dev container" in plan.stop and "Colab" in plan.stop


def test_an_old_python_stops_with_the_command_to_use():
    plan = _plan(python=(3, 10))
    assert "3.10" in plan.stop and "PYTHON=python3.12 bash setup.sh" in plan.stop


def _fake_smi(tmp_path, script: str):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n" + script + "\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    return dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", WORKBOOK_TORCH_INDEX="pypi")


def _torch_args(env):
    result = subprocess.run([sys.executable, "-m", "grader.setup_plan", "torch"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split(), result.stderr


def test_nvidia_smi_decides_the_build(tmp_path, monkeypatch):
    env = _fake_smi(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    args, notes = _torch_args(env)
    assert args == [f"torch=={setup_plan.pin('cuda', 'torch')}"] and "CUDA build" in notes
    env = _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9')
    args, notes = _torch_args(env)
    assert args == [f"torch=={setup_plan.pin('cpu', 'torch')}"] and "CPU build" in notes
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert setup_plan.nvidia_gpu() is False                        # no nvidia-smi at all


def test_a_kept_torch_is_not_replaced_by_the_pins(tmp_path):
    plan = _plan()
    assert setup_plan.constraints_for(plan, setup_plan.pin("cpu", "torch") + "+cpu", tmp_path / "c.txt") \
        == plan.constraints
    kept = setup_plan.constraints_for(plan, "2.12.0+cu128", tmp_path / "c.txt")
    text = kept.read_text()
    assert kept == tmp_path / "c.txt" and "numpy==" in text
    assert not re.search(r"^(torch|triton)==", text, re.M)


def test_check_passes_here():
    ok = subprocess.run([sys.executable, "-m", "grader.setup_plan", "check"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


# ---- the pins ------------------------------------------------------------------------------------

def _pins(kind):
    return doctor.tested_versions(kind)


def test_the_two_tested_sets():
    cpu, cuda = _pins("cpu"), _pins("cuda")
    for pins in (cpu, cuda):
        for name in ("torch", "triton", "numpy", "matplotlib", "jupyter", "nbval", "pytest", "ipykernel"):
            assert name in pins, f"{name} is not pinned"
    assert (cuda["torch"], cuda["triton"]) == ("2.11.0", "3.6.0"), "the pair the GPU test run used"
    assert set(cpu) == set(cuda)


def test_pyproject_floors_are_the_oldest_tested_pair():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"])
    oldest = min((doctor._version(_pins(k)["torch"]), doctor._version(_pins(k)["triton"])) for k in ("cpu", "cuda"))
    assert f"torch>={oldest[0][0]}.{oldest[0][1]}" in deps and f"triton>={oldest[1][0]}.{oldest[1][1]}" in deps
    assert doctor.FLOOR == {"torch": oldest[0][:2], "triton": oldest[1][:2]}
    assert project["requires-python"] == ">=" + ".".join(map(str, setup_plan.MIN_PYTHON))
    assert project["scripts"]["workbook"] == "grader.__main__:main"


def test_this_environment_is_a_tested_set():
    """The suite runs on a pinned set: CI on the CPU set, a GPU machine on the CUDA set's torch and triton."""
    import torch
    import triton
    installed = (torch.__version__.split("+")[0], triton.__version__)
    sets = {k: (_pins(k)["torch"], _pins(k)["triton"]) for k in ("cpu", "cuda")}
    assert installed in sets.values(), f"torch {installed[0]} with triton {installed[1]} is not in {sets}"


def test_gradescope_installs_the_same_pins():
    text = (ROOT / "grader" / "gradescope" / "setup.sh").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and all("constraints/cpu.txt" in line or "$PINS" in line for line in installs)
    assert "PINS=/autograder/source/constraints/cpu.txt" in text


@pytest.mark.parametrize("system, has_311, expected", [("3.12", False, "python3"), ("3.10", True, "python3.11"),
                                                       ("3.10", False, None)])
def test_gradescope_picks_a_python_the_workbook_runs_on(tmp_path, system, has_311, expected):
    """Ubuntu 24.04's python3 is used as it is; on 22.04 python3.11 is installed, else the
    instructor is told which base image to choose."""
    text = (ROOT / "grader" / "gradescope" / "setup.sh").read_text()
    function = text[text.index("pick_python() {"):text.index("\n}\n", text.index("pick_python() {")) + 3]
    fake = tmp_path / "bin"
    fake.mkdir()
    old = "import sys; sys.exit(1)" if system == "3.10" else "import sys; sys.exit(0)"

    def script(name, body):
        (fake / name).write_text("#!/bin/sh\n" + body + "\n")
        (fake / name).chmod(0o755)

    script("python3", f'case "$1" in --version) echo "Python {system}.4";; *) exec {sys.executable} -c "{old}";; esac')
    script("apt-get", "exit 0" if has_311 else "exit 100")
    if has_311:
        script("python3.11", f'exec {sys.executable} "$@"')
    done = subprocess.run(["bash", "-c", function + 'pick_python && echo "PY=$PY"'], capture_output=True, text=True,
                          env={"PATH": f"{fake}:/usr/bin:/bin"}, timeout=60)
    if expected:
        assert done.returncode == 0 and done.stdout.strip() == f"PY={expected}", done.stderr
    else:
        assert done.returncode != 0 and "choose the Ubuntu 24.04 base image" in done.stderr
        assert f"Python {system}.4" in done.stderr
