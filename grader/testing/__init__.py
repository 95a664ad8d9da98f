"""The grader's test infrastructure: what proves that its verdicts can be trusted.

    mutants.py         deliberately wrong solutions, built from the reference by small edits
    pytest_bridge.py   ``pytest tests/test_stageN.py`` as a front end onto the grader's checks (a plugin)
    sweep.py           ``sweep stageN --seeds K``: the reference graded on many seeds, each check's margin
"""
