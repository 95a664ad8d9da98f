"""``python -m grader doctor``: what will run on this machine, what will not, and how to fix it.

    python -m grader doctor          (or: workbook doctor)

It looks, without running any kernel, at:

    platform and Python     the workbook grades on Linux; macOS and Windows go through a dev container,
                            WSL2 or Colab (docs/platforms.md)
    torch, triton, CUDA     the installed versions against the tested sets in constraints/
    GPU                     name, compute capability, shared memory per block, bfloat16
    interpreter             whether Triton kernels run compiled or in the CPU interpreter
    name clashes            other distributions that install a top-level ``kernels`` or ``grader``
    caches                  free room where Triton and the CUDA stage keep their builds
    nvcc                    stage 4 compiles its .cu with it
    stages                  which stages and how many of their checks run here

Each finding is ``ok``, ``note`` (worth knowing), ``warn`` (something will be missing) or ``FAIL``
(something will break), and each one that is not ``ok`` says how to fix it.  The exit status is 1
when anything is ``FAIL``.  Facts are gathered once (:func:`gather`) and judged by plain functions
of them (:func:`findings`, :func:`stage_rows`), so the judgement can be tested for any machine.

The same module guards the grader on a platform without Triton (:func:`guard`): it says so up
front and grades only the stages that need no Triton, instead of an ImportError per check.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels.loader import ROOT

DISTRIBUTION = "flash-attention-workbook"
TOP_LEVEL = ("kernels", "grader")
CONSTRAINTS = {"cpu": ROOT / "constraints" / "cpu.txt", "cuda": ROOT / "constraints" / "cuda.txt"}
#: The oldest (torch, triton) pair the test suite ran on; pyproject.toml declares the same floors.
FLOOR = {"torch": (2, 11), "triton": (3, 6)}
#: Below this much free room a first run of every stage cannot keep its compiled kernels.
CACHE_ROOM = 1 << 30
#: The GPUs whose tile tables are tested (tests/test_targets.py compiles every configuration for each).
TESTED_CAPABILITIES = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0))


@dataclass
class GPU:
    name: str
    capability: tuple[int, int]
    smem_per_block: int          # bytes a block may opt in to


@dataclass
class Facts:
    """What :func:`gather` found; tests build their own."""
    platform: str                                # sys.platform: 'linux', 'darwin', 'win32'
    machine: str                                 # 'x86_64', 'arm64', 'aarch64', ...
    python: tuple[int, int, int]
    torch: str | None                            # '2.13.0+cpu'
    torch_cuda: str | None                       # CUDA version torch was built with, None for a CPU build
    triton: str | None
    gpu: GPU | None
    interpret_forced: bool                       # TRITON_INTERPRET=1 set by the user
    owners: dict[str, list[str]] = field(default_factory=dict)   # top-level name -> distributions
    imported_from: dict[str, str] = field(default_factory=dict)  # top-level name -> folder it imports from
    cache_free: dict[str, int | None] = field(default_factory=dict)  # cache folder -> free bytes (None: unwritable)
    nvcc: str | None = None                      # 'release 13.0' or None
    colab: bool = False


@dataclass
class Finding:
    topic: str
    status: str                 # 'ok', 'note', 'warn', 'FAIL'
    detail: str
    fix: str = ""


# ---- gathering ---------------------------------------------------------------------------------

def _version(text: str | None) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '3.6.0' -> (3, 6, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", (text or "").split("+")[0])[:3])


def tested_versions(kind: str) -> dict[str, str]:
    """Pins of one tested set ('cpu' or 'cuda') from constraints/: {'torch': '2.13.0', ...}."""
    pins = {}
    path = CONSTRAINTS[kind]
    if path.exists():
        for line in path.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> GPU | None:
    import torch
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or smem_limit((props.major, props.minor))
    return GPU(props.name, (props.major, props.minor), int(smem))


def _free(path: Path) -> int | None:
    """Free bytes where ``path`` is or would be created; None when it cannot be written."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return None
    return shutil.disk_usage(probe).free


def cache_folders() -> dict[str, Path]:
    from kernels import cuda_build
    triton_cache = os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"
    return {"Triton's kernel cache": Path(triton_cache),
            "the CUDA builds (stage 4, the op's C++ path)": cuda_build.cache_dir()}


def _nvcc() -> str | None:
    from kernels import cuda_build
    found = cuda_build.nvcc()
    if found is None:
        return None
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "found, but `nvcc --version` failed"
    m = re.search(r"release ([\d.]+)", out)
    return f"release {m.group(1)}" if m else "found"


def gather() -> Facts:
    """Look at this machine and this environment; imports torch, never triton."""
    from kernels import runtime

    import torch
    owners = importlib.metadata.packages_distributions()
    imported_from = {}
    for name in TOP_LEVEL:
        module = sys.modules.get(name) or __import__(name)
        imported_from[name] = str(Path(module.__file__).resolve().parent)
    return Facts(
        platform=sys.platform, machine=platform.machine(), python=tuple(sys.version_info[:3]),
        torch=torch.__version__, torch_cuda=torch.version.cuda,
        triton=_dist_version("triton") if runtime.HAS_TRITON else None, gpu=_gpu(),
        interpret_forced=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and torch.cuda.is_available(),
        owners={name: sorted(set(owners.get(name, []))) for name in TOP_LEVEL},
        imported_from=imported_from,
        cache_free={str(p): _free(p) for p in cache_folders().values()},
        nvcc=_nvcc(), colab="google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ,
    )


# ---- judging -----------------------------------------------------------------------------------

def smem_limit(capability: tuple[int, int]) -> int:
    """Shared memory one block may use (opt-in), in bytes, by compute capability (CUDA's tables)."""
    kb = {(7, 5): 64, (8, 0): 163, (8, 7): 163, (9, 0): 227, (10, 0): 227, (10, 3): 227}.get(capability)
    return (kb if kb is not None else 99) * 1024


def _platform_findings(f: Facts) -> list[Finding]:
    out = []
    name = {"linux": "Linux", "darwin": "macOS", "win32": "Windows"}.get(f.platform, f.platform)
    if f.platform == "linux":
        where = "Colab" if f.colab else "Linux"
        out.append(Finding("platform", "ok", f"{where} on {f.machine}: every stage can run here"))
    elif f.platform == "darwin":
        out.append(Finding("platform", "warn", f"{name} on {f.machine}: Triton has no build for macOS, so stages "
                           "2, 3 and 5-9 cannot run here; the grader's memory limit is not enforced either "
                           "(it reads /proc, which macOS lacks)",
                           "use the dev container (VS Code: 'Reopen in Container'; or a Codespace) or Colab; "
                           "see docs/platforms.md"))
    elif f.platform == "win32":
        out.append(Finding("platform", "FAIL", f"native {name}: Triton has no build for Windows, and the grader "
                           "runs learner code with POSIX process controls Windows lacks",
                           "use WSL2 (then follow the Linux steps), the dev container, or Colab; "
                           "see docs/platforms.md"))
    else:
        out.append(Finding("platform", "warn", f"{name} on {f.machine}: not a platform the workbook is tested on",
                           "use the dev container or Colab; see docs/platforms.md"))
    py = ".".join(map(str, f.python))
    if f.python[:2] < (3, 11):
        out.append(Finding("python", "FAIL", f"Python {py}; the workbook is tested on 3.11 and 3.12",
                           "create the environment with a newer Python: PYTHON=python3.12 bash setup.sh"))
    elif f.python[:2] > (3, 12):
        out.append(Finding("python", "note", f"Python {py}; the tested sets use 3.11 (CPU) and 3.12 (CUDA)",
                           "if a package fails to install, use Python 3.12: PYTHON=python3.12 bash setup.sh"))
    else:
        out.append(Finding("python", "ok", f"Python {py}"))
    return out


def _version_findings(f: Facts) -> list[Finding]:
    kind = "cuda" if f.gpu else "cpu"
    pins = tested_versions(kind)
    reinstall = f"bash setup.sh (it installs constraints/{kind}.txt)" if not f.colab else \
        "keep Colab's own torch; if a stage misbehaves, report the versions doctor prints"
    out = []
    for name, installed in (("torch", f.torch), ("triton", f.triton)):
        if installed is None:
            status = "FAIL" if f.platform == "linux" else "warn"
            out.append(Finding(name, status, f"{name} is not installed",
                               "bash setup.sh" if f.platform == "linux" else "see the platform finding above"))
            continue
        shown = f"{name} {installed}"
        if _version(installed)[:2] < FLOOR[name]:
            floor = ".".join(map(str, FLOOR[name]))
            out.append(Finding(name, "FAIL", f"{shown} is older than the oldest tested ({floor})", reinstall))
        elif _version(installed) != _version(pins.get(name)):
            out.append(Finding(name, "note", f"{shown}; the tested {kind.upper()} set has {pins.get(name, '?')}",
                               reinstall))
        else:
            out.append(Finding(name, "ok", f"{shown} (the tested {kind.upper()} set)"))
    if f.gpu and f.torch and not f.torch_cuda:
        out.append(Finding("CUDA", "FAIL", "a GPU is visible but torch is a CPU build",
                           "remove .venv and run bash setup.sh, which installs the CUDA build when nvidia-smi "
                           "sees a GPU"))
    elif f.torch_cuda:
        out.append(Finding("CUDA", "ok", f"torch built with CUDA {f.torch_cuda}"))
    return out


def _gpu_findings(f: Facts) -> list[Finding]:
    if f.gpu is None:
        return [Finding("GPU", "note", "no CUDA GPU visible: Triton kernels run in the CPU interpreter, at small "
                        "sizes; GPU-only checks (bfloat16, stage 4's kernel, timings) are reported 'not run'",
                        "for those, use a machine with an NVIDIA GPU or Colab (Runtime > Change runtime type > "
                        "T4 GPU)")]
    g = f.gpu
    cc = f"sm_{g.capability[0]}{g.capability[1]}"
    out = [Finding("GPU", "ok", f"{g.name}, {cc}, {g.smem_per_block // 1024} KB of shared memory per block")]
    if g.capability < (7, 5):
        out.append(Finding("GPU", "FAIL", f"{cc} is older than the oldest supported GPU (sm_75, a T4)",
                           "use Colab's T4 or any NVIDIA GPU from 2018 on"))
    if g.capability < (8, 0):
        out.append(Finding("bfloat16", "warn", f"{cc} has no bfloat16 tensor cores: the kernels take float16 and "
                           "float32 here, and bfloat16 checks fail with a message saying so; stage 4's CUDA kernel "
                           "(mma.sync.m16n8k16, cp.async) needs sm_80; float32 at head dim 256 does not fit "
                           f"{g.smem_per_block // 1024} KB of shared memory",
                           "for bfloat16 and stage 4's kernel, an sm_80 or newer GPU (A100, L4, RTX 30 and up)"))
    if g.capability not in TESTED_CAPABILITIES:
        out.append(Finding("GPU", "note", f"{cc} is not one of the targets the tile tables are compiled for in "
                           "the tests (" + ", ".join(f"sm_{a}{b}" for a, b in TESTED_CAPABILITIES) + ")",
                           "if a kernel fails with 'out of resources', report it with this output"))
    return out


def _interpreter_findings(f: Facts) -> list[Finding]:
    if f.gpu and f.interpret_forced:
        return [Finding("interpreter", "note", "TRITON_INTERPRET=1 is set, so Triton kernels run in the CPU "
                        "interpreter although a GPU is visible", "unset TRITON_INTERPRET to run them compiled")]
    if f.gpu:
        return [Finding("interpreter", "ok", "Triton kernels run compiled on the GPU")]
    return [Finding("interpreter", "ok", "Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)")]


def _clash_findings(f: Facts) -> list[Finding]:
    out = []
    for name in TOP_LEVEL:
        others = [d for d in f.owners.get(name, []) if d.lower().replace("_", "-") != DISTRIBUTION]
        folder = f.imported_from.get(name, "")
        expected = str(ROOT / name)
        if folder and folder != expected:
            out.append(Finding("names", "FAIL", f"`import {name}` loads {folder}, not the workbook's {expected}",
                               f"run from the workbook's folder in its own environment; "
                               f"pip uninstall {' '.join(others) or name} if another package provides it"))
        elif others:
            out.append(Finding("names", "warn", f"{', '.join(others)} also installs a top-level `{name}`, which "
                               "may shadow the workbook's in other folders or after a reinstall",
                               f"keep the workbook in its own environment (bash setup.sh makes .venv), or "
                               f"pip uninstall {' '.join(others)}"))
    if not out:
        out.append(Finding("names", "ok", "`kernels` and `grader` import the workbook's own code"))
    return out


def _cache_findings(f: Facts) -> list[Finding]:
    out = []
    for folder, free in f.cache_free.items():
        if free is None:
            out.append(Finding("caches", "FAIL", f"{folder} cannot be written",
                               "point TRITON_CACHE_DIR or WORKBOOK_CACHE at a writable folder"))
        elif free < CACHE_ROOM:
            out.append(Finding("caches", "warn", f"{free >> 20} MB free for {folder}; compiled kernels need up "
                               f"to {CACHE_ROOM >> 30} GB",
                               "free some disk, or point TRITON_CACHE_DIR / WORKBOOK_CACHE elsewhere"))
    if not out:
        shown = ", ".join(f"{folder} ({free >> 30} GB free)" for folder, free in f.cache_free.items())
        out.append(Finding("caches", "ok", shown))
    return out


def _nvcc_findings(f: Facts) -> list[Finding]:
    if f.nvcc:
        return [Finding("nvcc", "ok", f"nvcc {f.nvcc}: stage 4's .cu compiles here")]
    return [Finding("nvcc", "note", "nvcc not found: stage 4's 'cuda_source_compiles' check is not run, and on a "
                    "GPU its kernel cannot be built",
                    "install the CUDA toolkit (or set CUDA_HOME); the dev container and Colab have none and "
                    "need none for the other stages")]


def findings(f: Facts) -> list[Finding]:
    """Every finding for these facts, in the order they are printed."""
    return [*_platform_findings(f), *_version_findings(f), *_gpu_findings(f), *_interpreter_findings(f),
            *_clash_findings(f), *_cache_findings(f), *_nvcc_findings(f)]


# ---- stages ------------------------------------------------------------------------------------

def needs_triton(stage) -> bool:
    """Whether a stage's file imports triton (the learner's copy, else the reference)."""
    for folder in ("stages", "solutions"):
        path = ROOT / folder / f"{stage.module}.py"
        if path.exists():
            return re.search(r"^\s*(import|from)\s+triton\b", path.read_text(), re.M) is not None
    return False


def stage_rows(f: Facts) -> list[tuple[str, str]]:
    """(stage, what runs here) for every stage."""
    from grader import stages
    rows = []
    for stage in stages.STAGES:
        checks = stage.checks()
        if f.platform == "win32":
            rows.append((stage.name, "no: the grader needs Linux (WSL2, the dev container or Colab)"))
            continue
        if needs_triton(stage) and f.triton is None:
            rows.append((stage.name, "no: needs Triton (Linux only)"))
            continue
        gpu_only = [c for c in checks if c.gpu]
        skipped = [] if f.gpu else gpu_only
        if f.gpu and f.gpu.capability < (8, 0):
            sm = 10 * f.gpu.capability[0] + f.gpu.capability[1]
            skipped = [c for c in gpu_only if "bfloat16" in c.name or c.sm > sm]
        if stage.number == 4 and not f.nvcc:
            skipped += [c for c in checks if c.name == "cuda_source_compiles" and c not in skipped]
        ran = len(checks) - len(skipped)
        text = f"{ran} of {len(checks)} checks"
        if skipped:
            points = sum(c.points for c in skipped)
            why = "need a CUDA GPU" if not f.gpu else "need sm_80 or nvcc"
            text += f" ({len(skipped)} worth {points} points {why})"
        rows.append((stage.name, text))
    return rows


def guard(chosen: list | None, *, out=print) -> tuple[bool, list | None]:
    """Before grading: on a platform without Triton, say so first and drop the stages that need it.

    ``chosen`` is the list of stages asked for, or None for progress over all of them.  Returns
    ``(go on, stages to grade)``: ``chosen`` itself where nothing is missing; the stages that need no
    Triton where it is missing; ``(False, ...)`` when nothing asked for can be graded here.
    """
    from kernels import runtime
    if sys.platform == "win32":
        out("The grader cannot run on native Windows: it runs learner code in a worker process with POSIX "
            "controls (process groups, resource limits, /proc) that Windows lacks, and Triton has no Windows "
            "build.\nUse WSL2 (then follow the Linux steps), the dev container, or Colab: see docs/platforms.md.")
        return False, chosen
    if runtime.HAS_TRITON:
        return True, chosen
    out(runtime.no_triton_help() + "\n")
    if chosen is None:
        return True, None
    kept = [s for s in chosen if not needs_triton(s)]
    for stage in chosen:
        if stage not in kept:
            out(f"{stage.name} needs Triton, which is not installed here: not graded.")
    return bool(kept), kept


# ---- printing ----------------------------------------------------------------------------------

def report(f: Facts) -> tuple[str, bool]:
    """The text doctor prints, and whether nothing failed."""
    found = findings(f)
    lines = ["Flash Attention Workbook: doctor", ""]
    for x in found:
        lines.append(f"  {x.status:<5} {x.topic:<12} {x.detail}")
        if x.fix and x.status != "ok":
            lines.append(f"  {'':<5} {'':<12} fix: {x.fix}")
    lines += ["", "  stages here:"]
    lines += [f"    {name:<7} {text}" for name, text in stage_rows(f)]
    failed = [x for x in found if x.status == "FAIL"]
    lines += ["", f"  {len(failed)} problem(s) to fix first" if failed else "  nothing blocks the workbook here"]
    return "\n".join(lines), not failed


def main() -> int:
    """``python -m grader doctor``: print the report; 0 when nothing blocks the workbook here."""
    text, ok = report(gather())
    print(text)
    return 0 if ok else 1
