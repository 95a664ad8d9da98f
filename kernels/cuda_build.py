"""Build the workbook's CUDA kernels on first use, and cache them between runs.

A ``.cu`` stage file is compiled for one configuration at a time: its template parameters
arrive as ``-D`` flags (``-DHEAD_DIM=72 -DBLOCK_M=128 -DBLOCK_N=64``), so the kernel is built for
exactly the tiles the plan picked.  ``load`` compiles through ``torch.utils.cpp_extension``
(nvcc and ninja, for this GPU's architecture) into a folder of the user's cache named by a hash
of the source, the configuration and the GPU, and returns the library through ``ctypes``: the
kernels export plain C entry points and include no PyTorch header, so they compile in seconds.

``compile_only`` runs ``nvcc -c`` for a given architecture and needs no GPU: CI uses it to check
that a ``.cu`` file compiles for every architecture in ``ARCHS`` (tests/test_targets.py).

The workbook's kernels use ``mma.sync.m16n8k16``, ``cp.async`` and bfloat16, which need sm_80 or
newer: ``load`` refuses an older GPU (a T4 is sm_75) with a message saying so, before nvcc runs.

    WORKBOOK_CACHE   where builds are kept (default: $XDG_CACHE_HOME or ~/.cache, then
                     flash-attention-workbook/cuda)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
#: Architectures the CUDA stage is compiled for in the tests: A100, RTX 30, RTX 40 and L4, H100, RTX 50.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")
#: The oldest GPU the kernels run on: mma.sync.m16n8k16, cp.async and bfloat16 arrived with sm_80.
MIN_CAPABILITY = (8, 0)
#: nvcc releases that first compile for an architecture (older ones stop with 'unsupported gpu architecture').
NVCC_FOR_ARCH = {"sm_100": (12, 8), "sm_120": (12, 8), "sm_90": (11, 8), "sm_89": (11, 8)}
_loaded: dict[Path, ctypes.CDLL] = {}


def cache_dir() -> Path:
    """The folder builds are kept in (created on demand)."""
    env = os.environ.get("WORKBOOK_CACHE")
    if env:
        base = Path(env)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flash-attention-workbook"
    return base / "cuda"


def nvcc() -> str | None:
    """Path of nvcc: on the PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda; None if absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


def gencode(arch: str) -> str:
    """``-gencode`` for an architecture: 'sm_90' -> machine code for sm_90 ('sm_90a' for wgmma kernels)."""
    number = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{number},code=sm_{number}"


def device_arch(device=None) -> str:
    """'sm_90' for an H100, 'sm_80' for an A100, ... (the current CUDA device by default)."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def check_device(device=None, *, minimum: tuple[int, int] = MIN_CAPABILITY) -> None:
    """Refuse, with the reason and what still runs, a GPU older than the kernels need."""
    import torch
    capability = torch.cuda.get_device_capability(device)
    if capability >= minimum:
        return
    name = torch.cuda.get_device_name(device)
    need = f"sm_{minimum[0]}{minimum[1]}"
    raise RuntimeError(
        f"{name} is sm_{capability[0]}{capability[1]}; the workbook's CUDA kernels use mma.sync.m16n8k16, "
        f"cp.async and bfloat16, which need {need} or newer (A100, RTX 30/40/50, L4, H100). On this GPU the "
        "plan and the emulation run, and the Triton stages run in float16; for the CUDA kernel use a newer GPU "
        "(on Colab: an L4 or A100 runtime).")


def nvcc_release() -> tuple[int, int] | None:
    """nvcc's release, (13, 0) for CUDA 13.0; None without nvcc."""
    compiler = nvcc()
    if compiler is None:
        return None
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_nvcc_for(arch: str) -> None:
    """Refuse an nvcc too old for ``arch`` with the release it needs, instead of nvcc's own error."""
    need = NVCC_FOR_ARCH.get(arch.removesuffix("a"))
    have = nvcc_release()
    if need and have and have < need:
        raise RuntimeError(f"nvcc {have[0]}.{have[1]} cannot compile for {arch}: it needs CUDA {need[0]}.{need[1]} "
                           "or newer. Install a newer CUDA toolkit (or point CUDA_HOME at one).")


def _defines(defines: dict[str, int]) -> list[str]:
    return [f"-D{name}={value}" for name, value in sorted(defines.items())]


#: A build lock older than this was left by a process that died while building (a build takes a
#: minute or so); torch.utils.cpp_extension would wait for it forever.
STALE_LOCK_S = 600


def clear_stale_lock(build_dir: Path) -> None:
    """Wait while another process builds in ``build_dir`` (its ``lock``), or remove a lock left
    behind by one that died."""
    lock = build_dir / "lock"
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            return
        time.sleep(1)


def stable_source(build_dir: Path, filename: str, text: str) -> Path:
    """``build_dir/filename`` holding ``text``, the folder made and any stale build lock cleared.
    A build compiles this copy: its path stays the same from run to run (the caller's file may
    live in a temporary folder), so ninja's record stays valid."""
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    copy = build_dir / filename
    if not copy.exists() or copy.read_text() != text:
        copy.write_text(text)
    return copy


def library_path(source: Path, text: str, defines: dict[str, int], arch: str) -> Path:
    """Where ``load`` keeps the build of ``source`` (holding ``text``) with ``defines`` for ``arch``."""
    import torch
    key_text = "\n".join([text, repr(sorted(defines.items())), arch, " ".join(FLAGS), torch.__version__])
    name = f"{source.stem}_{hashlib.sha256(key_text.encode()).hexdigest()[:16]}"
    return cache_dir() / name / f"{name}.so"


def load(source: str | os.PathLike, *, defines: dict[str, int], label: str = "CUDA kernel",
         verbose: bool = False, arch: str | None = None) -> ctypes.CDLL:
    """Compile ``source`` with ``defines`` for this GPU (first use only) and return it as a ctypes library.

    ``arch`` overrides the GPU's architecture, e.g. 'sm_90a' for a kernel that uses wgmma.
    """
    source = Path(source)
    text = source.read_text()
    if arch is None:
        check_device()
    arch = arch or device_arch()
    library = library_path(source, text, defines, arch)
    if library in _loaded:
        return _loaded[library]
    build_dir, name = library.parent, library.stem
    if build_dir.exists():
        clear_stale_lock(build_dir)       # another process may be writing the library right now
    if not library.exists():
        check_nvcc_for(arch)
        config = " ".join(f"{k}={v}" for k, v in defines.items())
        print(f"compiling {label} for {config} (first use only, ~1 min)...", flush=True)
        copy = stable_source(build_dir, "kernel.cu", text)
        from torch.utils.cpp_extension import load as cpp_load
        started = time.monotonic()
        cpp_load(name=name, sources=[str(copy)], build_directory=str(build_dir), is_python_module=False,
                 extra_cuda_cflags=[gencode(arch), *FLAGS, *_defines(defines)], verbose=verbose)
        if verbose:
            print(f"built {library} in {time.monotonic() - started:.0f} s", flush=True)
    lib = ctypes.CDLL(str(library))
    _loaded[library] = lib
    return lib


def ptxas_by_function(report: str) -> dict[str, list[str]]:
    """What ``nvcc -Xptxas -v`` said of each kernel: the lines that name it (its warnings, such as
    C7514, "wgmma instructions are serialized") and its stack frame and spill line."""
    out: dict[str, list[str]] = {}
    current = None
    for line in report.splitlines():
        if "(C75" in line and line.count("'") >= 2:         # "... in [the] function '<name>'", before its entry
            out.setdefault(line.rsplit("'", 2)[-2], []).append(line)
        elif "Compiling entry function '" in line:
            current = line.split("'")[1]
            out.setdefault(current, [])
        elif "Function properties for " in line:
            current = line.split("Function properties for ")[1].strip()
        elif current and "bytes stack frame" in line:
            out.setdefault(current, []).append(line.strip())
    return out


@dataclass
class CompileResult:
    ok: bool
    command: str
    output: str
    seconds: float


def compile_only(source: str | os.PathLike, *, arch: str, defines: dict[str, int] | None = None,
                 extra: list[str] | None = None, timeout: float = 300) -> CompileResult:
    """``nvcc -c`` of ``source`` for ``arch`` ('sm_80', 'sm_90', ...): no GPU needed.

    Raises FileNotFoundError when nvcc is not installed.
    """
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc not found (looked on the PATH, in CUDA_HOME, CUDA_PATH and /usr/local/cuda)")
    with tempfile.TemporaryDirectory(prefix="workbook-nvcc-") as tmp:
        cmd = [compiler, "-c", gencode(arch), *FLAGS, *_defines(defines or {}), *(extra or []),
               str(source), "-o", str(Path(tmp) / "kernel.o")]
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return CompileResult(False, " ".join(cmd), f"nvcc ran past {timeout:.0f} s", time.monotonic() - started)
        return CompileResult(done.returncode == 0, " ".join(cmd), (done.stdout + done.stderr).strip(),
                             time.monotonic() - started)
