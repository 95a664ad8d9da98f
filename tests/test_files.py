"""Reading what a learner controls: links, FIFOs, odd bytes and names never hang, crash or leak."""

from __future__ import annotations

import os
import threading

from kernels import solution_file
from kernels.loader import ROOT

import pytest

from grader.isolation import files, private
from grader.publishing import release


def test_plain_files_are_read_and_nothing_else(tmp_path):
    plain = tmp_path / "a.py"
    plain.write_bytes(b"x = 1\n")
    assert files.read_plain(plain) == b"x = 1\n"
    assert files.read_plain(tmp_path / "missing.py") is None
    os.symlink(plain, tmp_path / "link.py")
    with pytest.raises(files.UnsafeFile, match="symbolic link"):
        files.read_plain(tmp_path / "link.py")
    os.mkfifo(tmp_path / "fifo.py")
    with pytest.raises(files.UnsafeFile, match="FIFO"):   # refused at once: opening it never blocks
        files.read_plain(tmp_path / "fifo.py")
    (tmp_path / "dir.py").mkdir()
    with pytest.raises(files.UnsafeFile, match="folder"):
        files.read_plain(tmp_path / "dir.py")
    (tmp_path / "big.py").write_bytes(b"#" * 100)
    with pytest.raises(files.UnsafeFile, match="at most 10 bytes"):
        files.read_plain(tmp_path / "big.py", limit=10)


def _solutions_copy(tmp_path):
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    src = ROOT / "solutions" / "stage1_online_softmax.py"
    (solutions / src.name).write_bytes(src.read_bytes())
    return solutions, src.name


def test_release_survives_fifos_and_undecodable_files(tmp_path):
    solutions, name = _solutions_copy(tmp_path)
    stages = tmp_path / "stages"
    stages.mkdir()
    os.mkfifo(solutions / "stage9_fifo.py")       # a FIFO where a solution would be: skipped, no hang
    os.mkfifo(stages / name)                        # and where the learner's file would be: not in sync
    done = threading.Event()
    result = {}

    def run():
        result["stale"] = release.check(stages=stages, solutions=solutions)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "release --check blocked on a FIFO"
    assert result["stale"] == [name]
    for data in (bytes(range(256)) * 8, "# -*- coding: latin-1 -*-\n# caf\xe9\n".encode("latin-1")):
        (stages / "x.py").unlink(missing_ok=True)
        target = tmp_path / "learner" / name
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(data)
        assert solution_file.is_untouched(target, solutions) is False


def test_forced_releases_never_overwrite_a_backup(tmp_path):
    solutions, name = _solutions_copy(tmp_path)
    stages = tmp_path / "stages"
    quiet = lambda *a: None  # noqa: E731
    release.release(stages=stages, solutions=solutions, log=quiet)
    edits = []
    for n in range(3):                               # within one second, as a script would
        edit = f"# edit {n}\n"
        (stages / name).write_text(edit)
        edits.append(edit)
        release.release(stages=stages, solutions=solutions, force=True, log=quiet)
    backups = sorted((stages / ".backup").iterdir())
    assert sorted(p.read_text() for p in backups) == sorted(edits)


def test_a_killed_graders_leftovers_are_swept(tmp_path):
    folder = private.private_dir()
    dead = 2**22 + 12345   # above Linux's largest pid: no such process
    left = folder / f"{dead}-stage1-leftover"
    left.mkdir()
    (left / "stage1_online_softmax.py").write_text("secret = 1\n")
    mine = folder / f"{os.getpid()}-stage1-mine"
    mine.mkdir()
    try:
        private.private_dir()
        assert not left.exists() and mine.exists()
    finally:
        mine.rmdir()
