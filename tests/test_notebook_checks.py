"""The verdict lines of the notebooks' check cells: passed, FAILED, or not written yet where the grader says todo."""

import types

from kernels.loader import ROOT

from grader.notebook_checks import checker, unfilled

LEARNER = ROOT / "stages" / "stage9_backward.py"          # as release wrote it: every hole unfilled
SOLUTION = ROOT / "solutions" / "stage9_backward.py"


def _line_of(path, label):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if label in line and "#" in line)


def _printed(capsys, path, run, todo="TODO(9b) and TODO(9c)"):
    checker(types.SimpleNamespace(__file__=str(path)))("dq, causal", run, todo)
    return capsys.readouterr().out


def test_a_failure_in_code_still_as_released_is_not_written_yet(capsys):
    out = _printed(capsys, LEARNER, lambda: ["dq: max error 0.9 > allowed 1e-05; got 0, expected 0.9"])
    assert out == (f"dq, causal: not written yet: TODO(9b) (line {_line_of(LEARNER, 'TODO(9b)')}), "
                   f"TODO(9c) (line {_line_of(LEARNER, 'TODO(9c)')}) still as released in stages/stage9_backward.py\n")
    assert "not written yet: TODO(9a)" in _printed(capsys, LEARNER, lambda: 1 / 0, todo="TODO(9a)")


def test_the_line_is_where_the_todo_is_now(tmp_path, capsys):
    moved = tmp_path / LEARNER.name
    moved.write_text("# my notes\n" * 7 + LEARNER.read_text())
    assert unfilled(moved, "TODO(9b)") == [("TODO(9b)", _line_of(LEARNER, "TODO(9b)") + 7)]


def test_filled_code_fails_with_its_problems_or_passes(tmp_path, capsys):
    assert _printed(capsys, SOLUTION, lambda: ["dq is wrong", "dk is wrong"]) == \
        "dq, causal: FAILED\n    dq is wrong\n    dk is wrong\n"
    assert _printed(capsys, SOLUTION, lambda: []) == "dq, causal: passed\n"
    assert _printed(capsys, LEARNER, lambda: []) == "dq, causal: passed\n"     # nothing failed: nothing to blame

    def boom():
        raise ValueError("sinks: got shape (3,), expected (4,)\nmore detail")
    assert _printed(capsys, SOLUTION, boom) == \
        "dq, causal: FAILED, it raised ValueError: sinks: got shape (3,), expected (4,)\n"


def test_a_hole_filled_elsewhere_is_not_blamed(tmp_path, capsys):
    text = LEARNER.read_text()
    line = _line_of(LEARNER, "TODO(9b)")
    lines = text.splitlines(keepends=True)
    stub = next(i for i in range(line, len(lines))
                if lines[i].strip() in ("pass", ) or "NotImplementedError" in lines[i])
    lines[stub] = lines[stub].replace(lines[stub].strip(), "delta = 0.0")
    edited = tmp_path / LEARNER.name
    edited.write_text("".join(lines))
    assert [label for label, _ in unfilled(edited, "TODO(9b) and TODO(9c)")] == ["TODO(9c)"]
    out = _printed(capsys, edited, lambda: ["wrong"], todo="TODO(9b)")
    assert out == "dq, causal: FAILED\n    wrong\n"


def test_not_implemented_in_code_the_learner_changed(capsys):
    def unwritten():
        raise NotImplementedError("write the dq loop")
    assert _printed(capsys, SOLUTION, unwritten) == \
        "dq, causal: not written yet (NotImplementedError: write the dq loop); fill in TODO(9b) and TODO(9c)\n"


def test_the_labels_a_check_names():
    from grader.notebook_checks import labels
    assert labels("TODO(2a) to TODO(2c)") == {"TODO(2a)", "TODO(2b)", "TODO(2c)"}
    assert labels("TODO(8a), TODO(8b) and TODO(8c)") == {"TODO(8a)", "TODO(8b)", "TODO(8c)"}
    assert labels("TODO(9a)") == {"TODO(9a)"} and labels("") == set()
