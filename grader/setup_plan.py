"""What ``setup.sh`` installs on this machine: which torch build, from where, with which pins.

It runs before anything is installed, so it uses the standard library alone:

    python -m grader.setup_plan check         stop early (exit 1) where the workbook cannot be set up
    python -m grader.setup_plan torch         the pip arguments that install torch, one per line
    python -m grader.setup_plan constraints   the constraints file for everything else

The rule:

    Linux, no NVIDIA GPU    the CPU build, from PyTorch's CPU index (no CUDA libraries to download)
    Linux, an NVIDIA GPU    the CUDA build, from PyTorch's CUDA index
    macOS                   the PyPI build (CPU and Apple's GPU); Triton has no macOS build, so only the
                            stages without Triton run there: setup says so
    Windows (Git Bash ...)  stop: use WSL2, the dev container or Colab

An NVIDIA GPU is one that ``nvidia-smi -L`` lists.  When PyTorch's index cannot be reached, torch
comes from the default index (PyPI, or the one pip is configured with), and the note says so: on
Linux that is the CUDA build, several GB.

Overrides, for CI and for machines the rule gets wrong:

    WORKBOOK_TORCH=cpu|cuda        which build
    WORKBOOK_TORCH_INDEX=URL|pypi  where torch comes from (pypi: pip's configured index)
    TORCH_SPEC="torch==2.11.0"     install this instead of the tested pin (then not the tested set)
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = {"cpu": "https://download.pytorch.org/whl/cpu", "cuda": "https://download.pytorch.org/whl/cu130"}
MIN_PYTHON = (3, 11)


@dataclass
class Plan:
    kind: str                   # 'cpu' or 'cuda': which constraints/ set
    torch_args: list[str]       # pip install arguments for torch
    notes: list[str]            # printed by setup.sh before installing
    stop: str = ""              # non-empty: do not set up here, and why

    @property
    def constraints(self) -> Path:
        return ROOT / "constraints" / f"{self.kind}.txt"


def nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (the driver is there, so the CUDA build can run)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(line.startswith("GPU ") for line in out.stdout.splitlines())


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/torch/", method="HEAD"), timeout=timeout)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pin(kind: str, name: str) -> str | None:
    """The version constraints/<kind>.txt pins ``name`` to."""
    for line in (ROOT / "constraints" / f"{kind}.txt").read_text().splitlines():
        m = re.match(rf"^{re.escape(name)}==([^\s;#]+)", line.strip(), re.I)
        if m:
            return m.group(1)
    return None


def make_plan(*, system: str, python: tuple[int, int], gpu: bool, env: dict, reachable=reachable) -> Plan:
    """The plan for a machine described by its arguments (``system`` as ``uname -s`` prints it)."""
    notes: list[str] = []
    if re.match(r"(MINGW|MSYS|CYGWIN|Windows)", system, re.I):
        return Plan("cpu", [], [], stop=(
            "This is Windows: Triton has no Windows build and the grader needs Linux's process controls. "
            "Use WSL2 (open an Ubuntu terminal, clone the workbook there, run bash setup.sh), the dev container "
            "(VS Code: 'Reopen in Container'), or Colab. docs/platforms.md walks through each."))
    if python < MIN_PYTHON:
        have, need = ".".join(map(str, python)), ".".join(map(str, MIN_PYTHON))
        return Plan("cpu", [], [], stop=(
            f"Python {have} is older than {need}, the oldest the tested sets install on. Run setup with a "
            f"newer one, for example: PYTHON=python3.12 bash setup.sh"))
    kind = env.get("WORKBOOK_TORCH") or ("cuda" if gpu and system == "Linux" else "cpu")
    if kind not in INDEX:
        return Plan("cpu", [], [], stop=f"WORKBOOK_TORCH={kind!r}: expected 'cpu' or 'cuda'")
    if system == "Darwin":
        notes.append("macOS: Triton has no macOS build, so stage 1 and stage 4's plan and emulation run here, and "
                     "stages 2, 3 and 5-9 do not. For those, open the workbook in its dev container (VS Code: "
                     "'Reopen in Container') or on Colab: see docs/platforms.md.")
    spec = env.get("TORCH_SPEC")
    if spec:
        notes.append(f"installing {spec} (TORCH_SPEC): not the tested set")
        return Plan(kind, [spec], notes)
    args = [f"torch=={pin(kind, 'torch')}"]
    index = env.get("WORKBOOK_TORCH_INDEX") or ("pypi" if system == "Darwin" else INDEX[kind])
    if index != "pypi":
        if reachable(index):
            args += ["--index-url", index]
        else:
            notes.append(f"{index} cannot be reached: torch comes from pip's default index instead"
                         + (" (on Linux that is the CUDA build, several GB)" if kind == "cpu" else ""))
    notes.append(f"torch: the {kind.upper()} build ({'an NVIDIA GPU is visible' if gpu else 'no NVIDIA GPU'}; "
                 f"WORKBOOK_TORCH=cpu|cuda chooses)")
    return Plan(kind, args, notes)


def constraints_for(plan: Plan, installed_torch: str | None, dest: Path) -> Path:
    """The tested set's constraints file, or, when a different torch is kept, a copy without torch and triton.

    setup.sh keeps a torch that is already installed (a CUDA build you chose, Colab's own); pinning the
    rest against it would make pip replace it.
    """
    wanted = pin(plan.kind, "torch")
    if installed_torch is None or installed_torch.split("+")[0] == wanted:
        return plan.constraints
    kept = [line for line in plan.constraints.read_text().splitlines()
            if not re.match(r"^(torch|triton)==", line.strip(), re.I)]
    dest.write_text("\n".join([f"# constraints/{plan.kind}.txt without torch and triton: torch {installed_torch} "
                               "was already installed and is kept", *kept]) + "\n")
    return dest


def _current_plan() -> Plan:
    return make_plan(system=platform.system() if os.name != "nt" else "Windows",
                     python=tuple(sys.version_info[:2]), gpu=nvidia_gpu(), env=dict(os.environ))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    what = argv[0] if argv else "check"
    if what == "check":
        plan = make_plan(system=platform.system() if os.name != "nt" else "Windows",
                         python=tuple(sys.version_info[:2]), gpu=False, env={"WORKBOOK_TORCH_INDEX": "pypi"})
        if plan.stop:
            print(plan.stop, file=sys.stderr)
            return 1
        return 0
    plan = _current_plan()
    if plan.stop:
        print(plan.stop, file=sys.stderr)
        return 1
    if what == "torch":
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
        print("\n".join(plan.torch_args))
        return 0
    if what == "constraints":
        installed = argv[1] if len(argv) > 1 and argv[1] else None
        print(constraints_for(plan, installed, Path(argv[2]) if len(argv) > 2 else ROOT / ".venv" / "constraints.txt"))
        return 0
    print(f"unknown request {what!r}: expected check, torch or constraints", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
