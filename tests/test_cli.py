"""python -m grader's command line: one parser, a subcommand per command, and every documented command
line still understood as written."""

import json
import re
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader.__main__ import _parse, main

DOCUMENTED_IN = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
                 "setup.sh", "workbook", ".devcontainer/post-create.sh", "grader/gradescope/run_autograder",
                 *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb"))]
COMMAND = re.compile(r"(?:^|[\s!(\"])(?:\S*python -m grader|(?:\./)?workbook)((?:[ \t]+[^\s#|;&()<>'\"`]+)*)")
PLACEHOLDERS = {"stageN": "stage3", "K": "5"}
MENTIONS = {("batch",), ("bench", "--json")}     # a command or an option named in prose, not a command line


def _snippets(path: Path):
    """The places a command line can be written: code spans and blocks, shell lines, notebook shell escapes."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        for cell in json.loads(text)["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                yield from re.findall(r"`([^`\n]+)`", source)
            else:
                yield from (line.split("#")[0] for line in source.splitlines() if line.lstrip().startswith("!"))
    elif path.suffix == ".md":
        yield from re.findall(r"`([^`\n]+)`", text)
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
            yield from (line.split("  #")[0] for line in block.splitlines())
    else:
        yield from (line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))


def documented() -> list[tuple[str, list[str]]]:
    found = {}
    for rel in DOCUMENTED_IN:
        for snippet in _snippets(ROOT / rel):
            for m in COMMAND.finditer(snippet):
                args = [PLACEHOLDERS.get(a, a) for a in m.group(1).replace("[", "").replace("]", "").split()]
                if not any("$" in a for a in args) and tuple(args) not in MENTIONS:   # no shell variables
                    found[" ".join(args)] = (rel, args)
    return sorted(found.values(), key=lambda f: f[1])


def test_the_documents_hold_command_lines():
    lines = [" ".join(args) for _, args in documented()]
    for expected in ("stage3 --notebook", "release --check", "batch submissions --stages stage5,stage6 --out grades",
                     "bench report docs/bench-h100.json", "update --from NEW", "doctor", ""):
        assert expected in lines, f"{expected!r} is no longer documented; found {lines}"


@pytest.mark.parametrize("where, args", documented(), ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_every_documented_command_line_parses(where, args):
    try:
        _parse(args)
    except SystemExit as exc:
        pytest.fail(f"python -m grader {' '.join(args)} (written in {where}) is refused: exit {exc.code}")


@pytest.mark.parametrize("args, command, options", [
    ([], "progress", {"solutions": False}),
    (["--fresh"], "progress", {"fresh": True}),
    (["stage3", "--solutions", "--only", "a", "--only", "b"], "grade", {"stages": "stage3", "only": ["a", "b"]}),
    (["stage5,stage6", "--format", "json"], "grade", {"stages": "stage5,stage6", "format": "json"}),
    (["3", "--list"], "grade", {"stages": "3", "list_checks": True}),
    (["bench", "stage5", "--rep", "500"], "bench", {"stages": "stage5", "rep": 500}),
    (["bench", "report", "x.json"], "bench report", {"json": "x.json"}),
    (["bench", "train", "--sizes", "a,b"], "bench train", {"sizes": "a,b"}),
    (["bench", "host"], "bench host", {}),
    (["bench", "host", "--repeat", "3", "--json", "h.json"], "bench host", {"repeat": 3, "json": "h.json"}),
    (["sweep", "stage1,stage2", "--seed", "3", "--seed", "4"], "sweep", {"exact_seeds": [3, 4]}),
    (["release", "--check"], "release", {"check_only": True}),
    (["stage1", "--memory-mb", "900", "--isolation", "none"], "grade", {"memory_mb": 900, "isolation": "none"}),
])
def test_each_command_is_a_subcommand_with_its_options(args, command, options):
    parsed = _parse(args)
    assert parsed.command == command
    assert {k: getattr(parsed, k) for k in options} == options


def test_stage_help_names_its_checks(capsys):
    assert main(["stage3", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m grader stage3")
    assert "Grade stage3: stages/stage3_flash_forward.py" in text and "head_dims_padded" in text
    assert "--only CHECK" in text and "--notebook" in text


@pytest.mark.parametrize("args, words", [
    (["stage3", "--solutions", "--submission", "x"], "choose different files"),
    (["stage3", "--out", "x.json"], "--out goes with --format json"),
    (["release", "--through", "stage3"], "go with --to DIR"),
    (["bench"], "required"),
])
def test_options_that_do_not_go_together_are_refused(args, words, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert words in err and f"python -m grader {args[0]}" in err      # the subcommand's own usage


def test_an_unknown_stage_lists_the_stages(capsys):
    assert main(["stage42", "--list"]) == 2
    assert "stage1 (stage1_online_softmax)" in capsys.readouterr().err
