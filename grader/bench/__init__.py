"""python -m grader bench: see grader/bench/measure.py."""

from grader.bench.measure import *  # noqa: F401,F403
