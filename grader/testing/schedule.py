"""The order in which the workbook's own test files start, for ``pytest -n 2 --dist loadfile``.

With ``--dist loadfile`` each file runs whole on one worker, and pytest-xdist starts the files with
the most tests first.  A few files hold few tests that take minutes (a class graded in the
sandbox, compiles with nvcc, notebooks run to the end), so they started last, and one worker
ran them alone while the other had finished.  This plugin (pyproject.toml loads it) turns that
reordering off and starts the files of ``LONGEST`` first, in its order, the rest as collected.
"""

from __future__ import annotations

#: Files whose tests took longest on two cores (``--durations``), longest first.
LONGEST = ("test_hostile.py", "test_fast_backward_wgmma.py", "test_learner_notebooks.py", "test_batch_loop.py",
           "09_backward.ipynb", "test_fast_variable_block.py", "test_hostile_protocol.py", "test_grader.py",
           "test_batch.py", "test_hostile_sandbox.py")


def pytest_configure(config):
    if getattr(config.option, "dist", None) == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)
    items.sort(key=rank)                      # stable: within a file, and for the rest, the collected order
