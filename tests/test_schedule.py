"""grader/testing/schedule.py: the longest test files start first under ``--dist loadfile``."""

from pathlib import Path
from types import SimpleNamespace

from grader.testing import schedule


def test_the_longest_files_start_first_and_the_rest_keep_their_order():
    def item(name, i):
        return SimpleNamespace(path=Path("/w/tests") / name, i=i)
    items = [item("test_a.py", 0), item("test_batch_loop.py", 1), item("test_b.py", 2), item("test_hostile.py", 3),
             item("test_batch_loop.py", 4), item("09_backward.ipynb", 5), item("test_a.py", 6)]
    schedule.pytest_collection_modifyitems(items)
    assert [(x.path.name, x.i) for x in items] == [
        ("test_hostile.py", 3), ("test_batch_loop.py", 1), ("test_batch_loop.py", 4), ("09_backward.ipynb", 5),
        ("test_a.py", 0), ("test_b.py", 2), ("test_a.py", 6)]


def test_xdist_keeps_that_order_only_where_it_schedules_by_file():
    for dist, reorder in (("loadfile", False), ("load", True), (None, True)):
        config = SimpleNamespace(option=SimpleNamespace(dist=dist, loadscopereorder=True))
        schedule.pytest_configure(config)
        assert config.option.loadscopereorder is reorder, dist
    config = SimpleNamespace(option=SimpleNamespace(dist="loadfile"))       # no xdist: nothing to turn off
    schedule.pytest_configure(config)
    assert not hasattr(config.option, "loadscopereorder")
