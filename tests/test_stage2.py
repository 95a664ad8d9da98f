from grader.testing.pytest_bridge import stage_tests

test_check = stage_tests("stage2")
