"""Hidden checks: graded like the others, never released, never named to the learner.

``grader/checks/hidden/stageN.py`` holds stage N's hidden checks, each marked
``@check(hidden=True)``.  ``python -m grader release --to DIR`` leaves this folder out of the
learner's bundle, and learner-facing output shows only "k hidden checks: x/y points".  A course
that wants its hidden checks to stay hidden keeps them in a private copy of the workbook; the
one here is an example.
"""
