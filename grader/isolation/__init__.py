"""Learner code kept apart from the grader: the worker process, its sandbox, and what crosses between them.

This package is what the sandbox shows the worker of the grader, so nothing here imports from the
rest of ``grader`` at import time.
"""
