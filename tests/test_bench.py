"""python -m grader bench without a GPU: FLOP counts, cases, the check-then-time loop, the table,
JSON, the plot and the command line."""

import dataclasses
import json
import warnings

from kernels import masks, reference, runtime
from kernels.loader import ROOT, load_file, load_package

import pytest
import torch

from grader import stages
from grader.__main__ import _parse
from grader.__main__ import main as cli
from grader.bench import cases, chart, measure, providers, tables, verify
from grader.bench.cases import Case

#: The stage 9 bench as sections 21 and 22 of docs/hopper-notes.md left it (the dense and GQA rows
#: from section 21's run, the windowed ones from section 22's): sections 11, 15, 19 and 22 and the
#: Hopper path's sixth step quote it.  The pages' current run is docs/bench-stage9-h200.json.
STAGE9_RUNS_21_22 = "hopper-probe-stage9-runs-21-22-h200.json"

F32 = torch.float32
HAS_SOLUTIONS = (ROOT / "solutions").is_dir()


def _brute_force_pairs(nq, nk, **opts) -> int:
    return int(masks.materialize(masks.attention_mask(nq, nk, **opts), nq, nk).sum())


@pytest.mark.parametrize("nq, nk, opts", [
    (37, 37, {}), (20, 53, {}),
    (64, 64, dict(causal=True)), (19, 70, dict(causal=True)), (70, 19, dict(causal=True)),
    (1, 33, dict(causal=True)), (33, 1, dict(causal=True)),
    (64, 64, dict(causal=True, window=1)), (64, 64, dict(causal=True, window=9)),
    (40, 70, dict(causal=True, window=16)), (70, 40, dict(causal=True, window=16)),
    (50, 50, dict(causal=True, window=200)),
    (64, 64, dict(causal=True, window=8, sink_tokens=3)), (40, 70, dict(causal=True, window=5, sink_tokens=20)),
    (70, 40, dict(causal=True, window=6, sink_tokens=4)), (30, 30, dict(causal=True, window=50, sink_tokens=5)),
    (64, 64, dict(causal=True, sink_tokens=4)),
])
def test_visible_pairs_match_a_brute_force_count(nq, nk, opts):
    assert cases.visible_pairs(nq, nk, **opts) == _brute_force_pairs(nq, nk, **opts)


def test_visible_pairs_at_a_benchmark_size():
    assert cases.visible_pairs(4096, 4096, causal=True, window=1024) == \
        _brute_force_pairs(4096, 4096, causal=True, window=1024)


def test_flops_count_visible_pairs_and_backward_is_two_and_a_half_forwards():
    fwd = Case(2, 8, 100, 90, 64, kv_heads=2, causal=True, window=10, sink_tokens=2)
    assert fwd.flops == 4 * 2 * 8 * 64 * _brute_force_pairs(100, 90, causal=True, window=10, sink_tokens=2)
    assert dataclasses.replace(fwd, backward=True).flops * 2 == fwd.flops * 5
    assert dataclasses.replace(fwd, sinks=True).flops == fwd.flops      # learned sinks add no pair
    with pytest.raises(ValueError, match="causal"):
        Case(1, 1, 8, 8, 16, window=4)


def test_every_stage_has_cases_its_solution_can_run_and_valid_providers():
    source = "solutions" if HAS_SOLUTIONS else "stages"
    assert list(cases.CASES) == sorted(cases.CASES, key=lambda s: int(s[5:]))
    for stage, stage_cases in cases.CASES.items():
        stages.find(stage)
        assert stage_cases, stage
        names = [c.name for c in stage_cases]
        assert len(set(names)) == len(names), f"{stage}: two cases share a name"
        chosen = cases.PROVIDERS.get(stage, cases.DEFAULT_PROVIDERS)
        assert chosen[0] == "solution" and set(chosen) <= set(cases.PROVIDER_NAMES), stage
        for name in chosen:
            assert providers.provider(name, stage, source).name == name
        solution = providers.StageKernel(stage, source)
        for case in stage_cases:             # the stage's own kernel takes every option of its cases
            assert case.dtype == torch.bfloat16
            fn = solution.module.flash_attention_backward if case.backward else solution.module.flash_attention
            solution._options(case, fn)
    assert [c.name for c in cases.CASES["stage9"] if c.backward] == \
        [c.name.replace(" fwd", " bwd") for c in cases.CASES["stage9"] if not c.backward]


def test_checked_heads_cover_a_whole_group_for_the_backward():
    assert verify.checked_heads(Case(4, 16, 64, 64, 64)) == (2, 2)
    assert verify.checked_heads(Case(4, 32, 64, 64, 64, kv_heads=8)) == (2, 1)
    assert verify.checked_heads(Case(4, 32, 64, 64, 64, kv_heads=8, backward=True)) == (4, 1)
    assert verify.checked_heads(Case(4, 16, 64, 64, 64, backward=True)) == (2, 2)
    assert verify.checked_heads(Case(1, 2, 64, 64, 64, kv_heads=1, backward=True)) == (2, 1)


class _Torch(providers.Provider):
    """PyTorch's attention in the inputs' dtype (right), optionally with a defect."""

    def __init__(self, name, o_scale=1.0, dk_scale=1.0, fail=False):
        self.name, self.o_scale, self.dk_scale, self.fail = name, o_scale, dk_scale, fail

    def attend(self, case, x):
        if self.fail:
            raise ZeroDivisionError("this provider breaks")
        return lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, compute_dtype=q.dtype,
                                                          **case.mask)[0] * self.o_scale

    def backward(self, case, x):
        g, o = super().backward(case, x)
        return (lambda: (lambda dq, dk, dv, *rest: (dq, dk * self.dk_scale, dv, *rest))(*g())), o


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_bench_checks_then_times_each_provider_and_reports_the_others(backward):
    case = Case(1, 4, 48, 48, 16, kv_heads=2, causal=True, window=8, sinks=True, backward=backward, dtype=F32)
    timed, metered = [], []

    def timer(fn):
        timed.append(fn())
        return 0.5

    def memory(make):                   # stands in for torch.cuda's peak: records what one run made
        metered.append(make())
        return 12.5

    providers = [_Torch("right"), _Torch("o-off", o_scale=1.01), _Torch("dk-off", dk_scale=1.01),
                 _Torch("broken", fail=True), "sdpa-flash"]
    rows = measure.run("stage9", cases=[case], providers=providers, device="cpu", timer=timer, memory=memory,
                       log=lambda *a, **k: None)
    got = {r["provider"]: r for r in rows}
    assert list(got) == ["right", "o-off", "dk-off", "broken", "sdpa-flash"]
    assert got["right"]["note"] == "" and got["right"]["ms"] == 0.5
    assert got["right"]["tflops"] == pytest.approx(case.flops / 0.5 * 1e-9)
    assert got["o-off"]["note"].startswith("wrong: o:") and got["o-off"]["ms"] is None
    if backward:
        assert got["dk-off"]["note"].startswith("wrong: dk:")
    else:
        assert got["dk-off"]["note"] == ""
    assert got["broken"]["note"] == "failed: ZeroDivisionError: this provider breaks"
    assert got["sdpa-flash"]["note"] == "n/a: SDPA has no sliding window"
    assert len(timed) == (1 if backward else 2)           # only what passed the check was timed
    assert len(metered) == len(timed)                     # ... and had its memory measured
    assert [r["peak_mib"] for r in rows] == ([12.5, None, None, None, None] if backward else
                                             [12.5, None, 12.5, None, None])
    assert all(r["input_mib"] == case.input_bytes / 2 ** 20 for r in rows)
    if backward:
        assert len(timed[0]) == 4 and timed[0][3].shape == (4,)   # dq, dk, dv and dsinks
        o, grads = metered[0]                             # a fresh forward, then its backward
        assert o.shape == (1, 4, 48, 16) and len(grads) == 4 and grads[1].shape == (1, 2, 48, 16)
    else:
        assert metered[0].shape == (1, 4, 48, 16)


class _Refills(providers.Provider):
    """Refills, in place, a tensor its graph saves each time it is set up (as flex does its mask's numbers)."""
    name = "refills"

    def __init__(self):
        self.scale = torch.ones(())

    def attend(self, case, x):
        self.scale.fill_(1.0)
        return lambda q, k, v, sinks: reference.attention(q * self.scale, k, v, sinks=sinks, compute_dtype=q.dtype,
                                                          **case.mask)[0]


def test_backward_times_the_graph_made_last():
    case = Case(1, 2, 24, 24, 16, causal=True, backward=True, dtype=F32)
    rows = measure.run("stage9", cases=[case], providers=[_Refills()], device="cpu", timer=lambda fn: fn() and 1.0,
                       memory=lambda make: make() and 2.0, log=lambda *a, **k: None)
    assert (rows[0]["note"], rows[0]["ms"], rows[0]["peak_mib"]) == ("", 1.0, 2.0)


def test_input_bytes_count_q_k_v_and_the_backward_s_do():
    case = Case(2, 8, 100, 60, 16, kv_heads=2, dtype=F32)
    assert case.input_bytes == (2 * 8 * 100 * 16 + 2 * 2 * 2 * 60 * 16) * 4
    back = dataclasses.replace(case, backward=True, dtype=torch.bfloat16)
    assert back.input_bytes == (2 * 2 * 8 * 100 * 16 + 2 * 2 * 2 * 60 * 16) * 2
    assert measure.peak_memory(lambda: torch.zeros(10), "cpu") is None     # torch.cuda keeps no peak for the CPU


@pytest.mark.skipif(not HAS_SOLUTIONS, reason="this copy of the workbook has no solutions/")
def test_bench_runs_the_stage_solution_forward_and_backward():
    cases = [Case(1, 4, 40, 40, 16, kv_heads=2, causal=True, window=8, sinks=True, dtype=F32),
             Case(1, 4, 40, 40, 16, kv_heads=2, causal=True, window=8, sinks=True, backward=True, dtype=F32)]
    device = "cuda" if runtime.ON_GPU else "cpu"         # the kernels run where the GPU is, if any
    rows = measure.run("stage9", source="solutions", cases=cases, providers=["solution"], device=device,
                       timer=lambda fn: 1.0, log=lambda *a, **k: None)
    assert [(r["note"], r["ms"]) for r in rows] == [("", 1.0), ("", 1.0)]
    rows = measure.run("stage5", source="solutions", cases=cases[:1], providers=["solution"], device=device,
                       timer=lambda fn: 1.0, log=lambda *a, **k: None)
    assert rows[0]["note"] == "n/a: stage5's flash_attention has no window option"


def test_flex_masks_follow_each_case_with_one_mask_mod_per_kind():
    flex = providers.FlexMasks("cpu")
    seen = {}
    for nq, nk, w, s in ((40, 40, 4, 0), (40, 40, 11, 0), (30, 50, 7, 0), (50, 30, 5, 3), (40, 40, 9, 2)):
        case = Case(1, 1, nq, nk, 16, causal=True, window=w, sink_tokens=s)
        mask_mod = flex.mask_mod(case)
        seen.setdefault(s > 0, set()).add(id(mask_mod))
        expected = masks.materialize(masks.attention_mask(nq, nk, **case.mask), nq, nk)
        assert torch.equal(masks.materialize(mask_mod, nq, nk), expected), case.name
    assert all(len(ids) == 1 for ids in seen.values())   # a new window reuses the function, so its kernel
    case = Case(1, 1, 30, 50, 16, causal=True)
    assert torch.equal(masks.materialize(flex.mask_mod(case), 30, 50),
                       masks.materialize(masks.attention_mask(30, 50, causal=True), 30, 50))


def test_flex_learned_sinks_correction_matches_the_reference(monkeypatch):
    import torch.nn.attention.flex_attention as fa
    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)   # eager flex: no compiler here
    case = Case(2, 4, 64, 80, 16, kv_heads=2, sinks=True, dtype=F32)
    x = cases.make_inputs(case, "cpu", seed=3)
    x.sinks[0], x.sinks[1] = 30.0, -30.0
    refs = verify.references(case, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = providers._flex_with_sinks(x.q, x.k, x.v, x.sinks, None, True)
        plain = providers._flex_plain(x.q, x.k, x.v, None, True)
    assert verify.verify({"o": o}, refs, case) is None
    assert verify.verify({"o": plain}, refs, case).startswith("o: max error")


ROWS = [
    {"stage": "stage7", "case": "A fwd", "provider": "solution", "ms": 1.0, "tflops": 200.0, "peak_mib": 3.0,
     "input_mib": 96.0, "note": ""},
    {"stage": "stage7", "case": "A fwd", "provider": "sdpa-flash", "ms": None, "tflops": None,
     "note": "n/a: SDPA has no sliding window"},
    {"stage": "stage7", "case": "A fwd", "provider": "flex", "ms": 2.0, "tflops": 100.0, "peak_mib": 40.0,
     "input_mib": 96.0, "note": ""},
    {"stage": "stage7", "case": "B fwd", "provider": "solution", "ms": None, "tflops": None,
     "note": "wrong: o: max error 1 > allowed 0.1"},
    {"stage": "stage7", "case": "B fwd", "provider": "sdpa-flash", "ms": None, "tflops": None,
     "note": "n/a: SDPA has no sliding window"},
    {"stage": "stage7", "case": "B fwd", "provider": "flex", "ms": 1.0, "tflops": 50.0, "note": ""},
    {"stage": "stage8", "case": "C fwd", "provider": "solution", "ms": 1.0, "tflops": 30.0, "note": ""},
    {"stage": "stage8", "case": "C fwd", "provider": "flex", "ms": 1.0, "tflops": 40.0, "note": ""},
]


def test_table_shows_throughput_ratios_and_notes():
    text = tables.table(ROWS)
    lines = text.splitlines()
    a = next(line for line in lines if line.startswith("A fwd"))
    assert a.split() == ["A", "fwd", "200.0", "n/a", "100.0", "-", "2.00x"]
    b = next(line for line in lines if line.startswith("B fwd"))
    assert b.split() == ["B", "fwd", "wrong", "n/a", "50.0", "-", "-"]
    c = next(line for line in lines if line.startswith("C fwd"))
    assert c.split() == ["C", "fwd", "30.0", "40.0", "0.75x"]
    assert lines.index("stage7:") < lines.index("stage8:") < lines.index(c)
    assert "  stage7 2 cases / sdpa-flash: n/a: SDPA has no sliding window" in lines
    assert "  stage7 B fwd / solution: wrong: o: max error 1 > allowed 0.1" in lines
    memory = lines.index("stage7 peak memory, MiB beyond the inputs (bwd: the forward, then the backward):")
    assert lines[memory + 1].split() == ["case", "inputs", "solution", "sdpa-flash", "flex"]
    assert lines[memory + 2].split() == ["A", "fwd", "96", "3", "-", "40"]
    assert lines[memory + 3].split() == ["B", "fwd", "-", "-", "-", "-"]
    assert not any(line.startswith("stage8 peak memory") for line in lines)     # no stage8 row has a peak


def test_bench_hands_over_each_case_as_it_is_timed():
    """``run``'s ``each_case`` gets each case's rows once that case is timed, in order."""
    cases = [Case(1, 2, 16, 16, 16, dtype=F32), Case(1, 2, 32, 32, 16, causal=True, dtype=F32)]
    handed = []
    rows = measure.run("stage9", cases=cases, providers=[_Torch("right"), _Torch("broken", fail=True)], device="cpu",
                       timer=lambda fn: (fn(), 0.5)[1], memory=lambda make: (make(), 1.0)[1],
                       log=lambda *a, **k: None, each_case=lambda case_rows: handed.append(list(case_rows)))
    assert [[(r["case"], r["provider"]) for r in h] for h in handed] == [
        [(c.name, "right"), (c.name, "broken")] for c in cases]
    assert sum(handed, []) == rows


def test_a_bench_cut_short_keeps_the_cases_it_timed(tmp_path, monkeypatch):
    """``bench --json`` writes the rows after each case: a run stopped in its third case (a time
    limit, an interrupt) leaves a JSON of the two before it, and a whole run (two stages) a JSON of
    every case."""
    path = tmp_path / "bench.json"
    row = dict(stage="stage9", provider="op", ms=1.0, tflops=1.0, peak_mib=1.0, input_mib=1.0, note="")
    stop = [True]

    def run(stage, *, each_case, **kwargs):
        for case in ("first", "second"):
            each_case([dict(row, stage=stage, case=case)])
        if stop[0]:
            raise KeyboardInterrupt
    monkeypatch.setattr(measure.runtime, "ON_GPU", True)
    monkeypatch.setattr(measure.runtime, "describe", lambda: "a GPU")
    monkeypatch.setattr(measure, "run", run)
    monkeypatch.setattr(measure, "table", lambda rows: "")
    with pytest.raises(KeyboardInterrupt):
        measure.main("stage9", json_path=str(path))
    assert [r["case"] for r in json.loads(path.read_text())["rows"]] == ["first", "second"]
    stop[0] = False
    assert measure.main("stage5,stage9", json_path=str(path)) == 0
    assert [(r["stage"], r["case"]) for r in json.loads(path.read_text())["rows"]] == [
        (stage, case) for stage in ("stage5", "stage9") for case in ("first", "second")]


def test_json_rows_round_trip(tmp_path):
    path = tmp_path / "bench.json"
    tables.write_json([dict(r, extra="dropped") for r in ROWS], path)
    written = json.loads(path.read_text())
    assert written["rows"] == [{k: r.get(k) for k in tables.JSON_KEYS} for r in ROWS]
    assert set(tables.JSON_KEYS) >= {"stage", "case", "provider", "ms", "tflops", "peak_mib"}
    assert written["torch"] == torch.__version__ and written["device"]


@pytest.mark.parametrize("source, page_name, device", [
    ("bench-h100.json", "performance", "NVIDIA H100"),
    ("bench-stage9-h200.json", "performance-stage9-h200", "NVIDIA H200"),    # H100 and H200 runs kept apart
    ("bench-stage45-h100.json", "performance-stage45-h100", "NVIDIA H100"),
    ("bench-stage678-h200.json", "performance-stage678-h200", "NVIDIA H200"),
])
def test_the_performance_page_is_generated_from_the_committed_json(source, page_name, device):
    """Each performance page is what `bench report` makes of its committed JSON: it cannot drift."""
    from grader.bench import report as bench_report
    page = bench_report.render(f"docs/{source}", chart=f"{page_name}.png")
    assert (ROOT / "docs" / f"{page_name}.md").read_text() == page
    assert (ROOT / "docs" / f"{page_name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta, rows = bench_report.load(ROOT / "docs" / source)
    assert meta["device"].startswith(device) and rows
    for r in rows:   # every measured TFLOP/s the JSON holds is on the page
        if r["tflops"]:
            assert f"{r['tflops']:.0f}" in page
    # README's speed claims: test_readme_speed_ratios_are_the_committed_bench_s


def test_report_writes_the_page_and_its_chart(tmp_path):
    from grader.bench import report as bench_report
    source, page = tmp_path / "bench.json", tmp_path / "perf.md"
    tables.write_json(ROWS, source)
    assert bench_report.main(str(source), out=str(page)) == 0
    text = page.read_text()
    assert "](perf.png)" in text and (tmp_path / "perf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert text == bench_report.render(source, chart="perf.png")


def test_plot_writes_a_png_with_a_panel_per_stage(tmp_path):
    import matplotlib.image
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    chart.plot(ROWS[:6], one)
    chart.plot(ROWS, two, title="test")
    assert one.read_bytes()[:8] == two.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(two).shape[0] > matplotlib.image.imread(one).shape[0]


def test_command_line_arguments(capsys):
    assert _parse(["bench", "stage5", "--learner"]).learner
    assert _parse(["bench", "all", "--solutions"]).solutions          # the old flag, now the default
    assert cli(["bench", "stage5", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--solutions" not in text and "--learner" in text
    assert measure._stages("all") == list(cases.CASES)
    assert measure._stages("5,stage7") == ["stage5", "stage7"]

    assert cli(["bench", "stage99"]) == 2
    err = capsys.readouterr().err
    assert "stage99" in err and all(stage in err for stage in cases.CASES) and "all" in err
    assert cli(["bench", "stage5", "--providers", "solution,nope"]) == 2
    err = capsys.readouterr().err
    assert "--providers" in err and "'nope'" in err and "flex" in err
    assert cli(["bench", "stage5", "--rep", "0"]) == 2
    assert "--rep" in capsys.readouterr().err
    assert cli(["bench", "stage5", "--learner", "--solutions"]) == 2
    assert "--learner" in capsys.readouterr().err


@pytest.mark.skipif(runtime.ON_GPU, reason="checks the message given where no GPU is visible")
@pytest.mark.parametrize("argv", [["stage5"], ["all", "--learner", "--json", "x.json"]])
def test_without_a_gpu_bench_says_why_and_returns_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "GPU" in err and "python -m grader bench" in err
    assert not (tmp_path / "x.json").exists()


def test_readme_speed_ratios_are_the_committed_bench_s():
    """README's speed line is a promise: each range it gives is the one docs/bench-h100.json holds, for
    the fastest of the Triton solutions (stages 3 and 5-9, TMA variants included) against each provider."""
    rows = json.loads((ROOT / "docs" / "bench-h100.json").read_text())["rows"]
    by_case: dict = {}
    for r in rows:
        if r["stage"] != "stage4":
            by_case.setdefault((r["stage"], r["case"]), {})[r["provider"]] = r["tflops"]
    ratios: dict = {}
    for (_, case), tf in by_case.items():
        ours = max(tf.get("solution") or 0, tf.get("solution-tma") or 0)
        kind = "bwd" if case.endswith("bwd") else "fwd"
        for other in ("sdpa-flash", "sdpa-cudnn", "flex"):
            if tf.get(other):
                ratios.setdefault(other, []).append(ours / tf[other])
                ratios.setdefault((other, kind), []).append(ours / tf[other])

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}x"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"run {span(ratios['sdpa-flash'])} SDPA's FlashAttention-2" in readme
    assert f"and {span(ratios['flex'])} FlexAttention" in readme
    assert (f"{span(ratios[('sdpa-cudnn', 'fwd')])} its forward and {span(ratios[('sdpa-cudnn', 'bwd')])} "
            "its backward") in readme


def _op_kernels_run(run: str | None = None) -> dict:
    """docs/hopper-probe-op-kernels-h200.json's rows of one run (the newest by default) as
    ``{case: {provider: row}}``."""
    rows = json.loads((ROOT / "docs" / "hopper-probe-op-kernels-h200.json").read_text())["rows"]
    run = run or rows[-1]["run"]
    by_case: dict = {}
    for r in rows:
        if r["run"] == run:
            by_case.setdefault(r["case"], {})[r["provider"]] = r
    return by_case


def test_readme_op_ratios_are_the_committed_bench_s():
    """README's line on the op is the range docs/bench-stage9-h200.json holds for provider ``op``
    against cuDNN, FA2 and FlexAttention timed beside it, forward and backward."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    rows = json.loads((ROOT / "docs" / "bench-stage9-h200.json").read_text())["rows"]
    ms = {(r["case"], r["provider"]): r["ms"] for r in rows if r["ms"]}
    for other, words in (("sdpa-cudnn", "cuDNN"), ("sdpa-flash", "FA2"), ("flex", "FlexAttention")):
        fwd, bwd = (f"{min(v):.2f}-{max(v):.2f}x" for v in (
            [ms[c, other] / ms[c, "op"] for c, p in ms if p == other and c.endswith(kind) and (c, "op") in ms]
            for kind in ("fwd", "bwd")))
        assert f"{fwd.removesuffix('x')}x/{bwd} {words}" in readme, (other, fwd, bwd)


_WORDS = dict(enumerate("no one two three four five six seven eight nine ten eleven twelve".split()))


def _rows_cudnn_beats(ms: dict) -> tuple[list, list]:
    """The stage 9 bench's cases timed with cuDNN and the op, in the JSON's order, and those where
    cuDNN took less time than the op."""
    timed = [c for c, p in ms if p == "sdpa-cudnn" and (c, "op") in ms]
    return timed, [c for c in timed if ms[c, "sdpa-cudnn"] < ms[c, "op"]]


def _named(cases: list) -> str:
    """"the D64 backward, the D64 causal forward and backward": dense cases by head dim, mask and
    direction, a case's two directions named together."""
    names: dict[str, list] = {}
    for c in cases:
        shape, direction = c.rsplit(" ", 1)
        names.setdefault(shape.split(" ", 3)[-1], []).append({"fwd": "forward", "bwd": "backward"}[direction])
    return ", ".join(f"the {shape} {' and '.join(d)}" for shape, d in names.items())


def _probe(name: str):
    """grader/bench/probes/<name>.py as a module (the probes are scripts, not a package)."""
    return load_file(ROOT / "grader" / "bench" / "probes" / f"{name}.py")


def _rows_by_case(name: str) -> dict:
    """docs/<name>'s rows as ``{case: {provider: row}}``."""
    by_case: dict = {}
    for r in json.loads((ROOT / "docs" / name).read_text())["rows"]:
        by_case.setdefault(r["case"], {})[r["provider"]] = r
    return by_case


def _section(notes: str, heading: str) -> str:
    """The notes' section that starts with ``heading``, up to the next heading of its level."""
    start = notes.index(heading)
    return notes[start:notes.index("\n## ", start + 1)]


def _names_its_run(notes: str, doc: dict) -> bool:
    """Whether the notes name the GPU and the versions a probe's JSON recorded, as one phrase."""
    return f"{doc['gpu']} (torch {doc['torch']}, triton {doc['triton']}" in " ".join(notes.split())


def _backward_rows(name: str, base: str, others: tuple) -> list[str]:
    """Table rows of docs/<name>: per case that cuDNN ran, the backward TFLOP/s of cuDNN, ``base``
    and ``others``, then each of ``others`` as a speed against ``base``, all from the JSON."""
    lines = []
    for case, of in _rows_by_case(name).items():
        if "cudnn" in of:
            cells = [f"{of[p]['bwd_tflops']:.0f}" for p in ("cudnn", base, *others)]
            cells += [f"{of[base]['bwd_ms'] / of[p]['bwd_ms']:.2f}x" for p in others]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def test_the_spill_table_in_the_notes_is_the_committed_probe_s():
    """docs/hopper-notes.md's table of spilling tiles is what grader/bench/probes/register_spills.py's
    summary makes of the JSON committed beside it."""
    probe = _probe("register_spills")
    doc = json.loads((ROOT / "docs" / "hopper-probe-register-spills.json").read_text())
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    lines = probe.summary(doc["rows"])
    assert len(lines) > 2 and all(line in notes for line in lines), "\n".join(lines)
    assert f"Triton {doc['triton']}" in notes and not [r for r in doc["rows"] if "error" in r]


def test_the_one_pass_table_in_the_notes_is_the_committed_run_s():
    """docs/hopper-notes.md's section 6 gives, for each case of docs/hopper-probe-one-pass-h200.json
    that cuDNN ran, the backward TFLOP/s of cuDNN, main's TMA backward and the branch's two
    backwards, and their speed against main's, all from that one run."""
    lines = _backward_rows("hopper-probe-one-pass-h200.json", "tma-main", ("op-two-kernels", "op-one-pass"))
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    assert len(lines) == 5 and all(line in notes for line in lines), "\n".join(lines)


def test_the_minimal_one_pass_table_in_the_notes_is_the_committed_probe_s():
    """Section 6's table of the minimal one-pass backward is docs/hopper-probe-fused-dq-h200.json's:
    backward TFLOP/s of cuDNN, the TMA backward and the two one-pass variants, and their speed
    against the TMA backward, from one run."""
    lines = ["  " + line for line in _backward_rows("hopper-probe-fused-dq-h200.json", "tma",
                                                    ("fused-tma", "fused-atomic"))]
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    assert len(lines) == 4 and all(line in notes for line in lines), "\n".join(lines)


def test_the_split_query_table_in_the_notes_is_the_committed_probe_s():
    """Section 7's table is what grader/bench/probes/split_q_forward.py's summary makes of the JSON
    committed beside it, and every tile that ran was checked (the probe records a wrong one as an
    error)."""
    probe = _probe("split_q_forward")
    doc = json.loads((ROOT / "docs" / "hopper-probe-split-q-h200.json").read_text())
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    lines = probe.summary(doc["rows"])
    assert len(lines) == 6 and all(line in notes for line in lines), "\n".join(lines)
    assert not [r for r in doc["rows"] if "error" in r] and _names_its_run(notes, doc)


@pytest.mark.parametrize("probe, source, rows, section", [
    ("wgmma_forward", "hopper-probe-wgmma-forward-h200.json", 6, 8),
    ("wgmma_schedule", "hopper-probe-wgmma-schedule-h200.json", 11, 10),
    ("wgmma_window_tiles", "hopper-probe-wgmma-window-h200.json", 4, 10)])
def test_the_wgmma_tables_in_the_notes_are_the_committed_probes(probe, source, rows, section):
    """Sections 8's and 10's tables are what their probes' summaries make of the JSON committed
    beside them; no kernel that ran gave a wrong output; the section names the run's GPU, versions
    and CUDA compiler."""
    doc = json.loads((ROOT / "docs" / source).read_text())
    lines = _probe(probe).summary(doc["rows"])
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    text = notes.split(f"\n## {section}. ")[1].split("\n## ")[0]
    assert len(lines) == rows and all(line in text for line in lines), "\n".join(lines)
    assert not [r for r in doc["rows"] if "error" in r] and _names_its_run(text, doc)
    assert f"nvcc {doc['nvcc']})" in " ".join(text.split()), "the section names the CUDA compiler the run built with"


def test_the_notes_ranges_for_the_wgmma_forward_on_the_h100_are_the_committed_bench_s():
    """Section 10's line on docs/bench-stage45-h100.json, and README's: the wgmma forward against
    cuDNN on stage 5's cases and stage 4's, and the TMA forward's against cuDNN on stage 5's."""
    doc = json.loads((ROOT / "docs" / "bench-stage45-h100.json").read_text())
    get = {(r["stage"], r["case"], r["provider"]): r["tflops"] for r in doc["rows"]}

    def span(stage, provider):
        ratios = [get[s, c, provider] / get[s, c, "sdpa-cudnn"] for s, c, p in get
                  if s == stage and p == provider and get[s, c, provider] and get.get((s, c, "sdpa-cudnn"))]
        assert len(ratios) == 4, (stage, provider)
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert doc["device"].startswith("NVIDIA H100")
    assert (f"the wgmma forward at {span('stage5', 'solution-wgmma')} cuDNN on stage 5's dense cases (D64 and "
            f"D128, causal and not) and {span('stage4', 'solution-wgmma')} on stage 4's head dims; on stage 5 the "
            f"TMA forward reached {span('stage5', 'solution-tma')} cuDNN") in notes
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"reaches cuDNN's forward in one H100 run: {span('stage5', 'solution-wgmma')} on stage 5" in readme


def test_notebook_4s_figures_for_the_wgmma_variant_are_the_committed_h100_bench_s():
    """Stage 4's notebook quotes the wgmma variant's TFLOP/s and its ratios to FlashAttention-2 and
    cuDNN from docs/bench-stage45-h100.json's stage 4 rows."""
    doc = json.loads((ROOT / "docs" / "bench-stage45-h100.json").read_text())
    get = {(r["case"], r["provider"]): r["tflops"] for r in doc["rows"] if r["stage"] == "stage4"}
    cases = [f"B4 H16 N4096 D{d} fwd" for d in (48, 72, 96, 160)]
    cells = json.loads((ROOT / "notebooks" / "04_variable_block.ipynb").read_text())["cells"]
    text = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())

    def span(other):
        ratios = [get[c, "solution-wgmma"] / get[c, other] for c in cases]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"
    tflops = [f"{get[c, 'solution-wgmma']:.1f}" for c in cases]
    figures = ", ".join(tflops[:3]) + f" and {tflops[3]}"
    assert doc["device"] in text
    assert (f"{figures} TFLOP/s at D = 48, 72, 96 and 160, that is {span('sdpa-flash')} FlashAttention-2 and "
            f"{span('sdpa-cudnn')} cuDNN in the same run") in text


def test_the_notes_range_for_deeper_wgmma_rings_is_the_committed_probe_s():
    """Section 10's line on docs/hopper-probe-wgmma-stages-h200.json: each tile with three or four
    stages against the same tile with two, in the same run."""
    rows = json.loads((ROOT / "docs" / "hopper-probe-wgmma-stages-h200.json").read_text())["rows"]
    get = {(r["case"], r["provider"]): r["tflops"] for r in rows}
    ratios = [t / get[c, p.replace(f"/{n}s ", "/2s ")] for (c, p), t in get.items()
              for n in (3, 4) if f"/{n}s " in p]
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert len(ratios) == 8 and f"{min(ratios):.2f}-{max(ratios):.2f}x the same tile with two" in notes


def test_the_notes_figures_for_the_wgmma_forward_at_stages_6_to_8_are_the_committed_bench_s():
    """Section 10's list on docs/bench-stage678-h200.json: the wgmma forward against cuDNN, the TMA
    forward and FlexAttention, each from the JSON."""
    doc = json.loads((ROOT / "docs" / "bench-stage678-h200.json").read_text())
    get = {(r["case"], r["provider"]): r["tflops"] for r in doc["rows"]}

    def ratio(case, other):
        return f"{get[case, 'solution-wgmma'] / get[case, other]:.2f}x"

    def span(cases, other):
        values = sorted(ratio(c, other) for c in cases)
        return f"{values[0].removesuffix('x')}-{values[-1]}"
    gqa = [f"B4 Hq32/Hkv8 N4096 D{d} causal fwd" for d in (128, 64)]
    full = "B4 Hq32/Hkv8 N8192 D64 causal sinks fwd"
    windows = {w: [f"B4 Hq32/Hkv8 N8192 D64 W{w}{s} fwd" for s in ("", " sinks")] for w in (128, 1024)}
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert doc["device"] == "NVIDIA H200"
    assert (f"{ratio(gqa[0], 'sdpa-cudnn')} cuDNN at D128 and {ratio(gqa[1], 'sdpa-cudnn')} at D64, "
            f"{ratio(gqa[0], 'solution-tma')} and {ratio(gqa[1], 'solution-tma')} the TMA forward") in notes
    assert f"{ratio(full, 'solution-tma')} the TMA forward, {ratio(full, 'flex')} FlexAttention" in notes
    assert (f"slower than the TMA forward**, {span(windows[128], 'solution-tma')} at 128 keys and "
            f"{span(windows[1024], 'solution-tma')} at 1024") in notes


def test_the_backward_kernels_table_in_the_notes_is_the_committed_probe_s():
    """Section 9's table is what grader/bench/probes/backward_kernels.py's summary makes of the JSON
    committed beside it."""
    doc = json.loads((ROOT / "docs" / "hopper-probe-backward-kernels-h200.json").read_text())
    lines = _probe("backward_kernels").summary(doc["rows"])
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    assert len(lines) == 6 and all(line in notes for line in lines), "\n".join(lines)
    assert _names_its_run(notes, doc)


def test_the_report_rates_the_op_against_the_others_as_it_rates_the_solution(tmp_path):
    """The op is what a user calls: the page gives its speed against cuDNN, FA2 and FlexAttention,
    not the solution's against the op's."""
    from grader.bench import report as bench_report
    rows = [dict(stage="stage9", case="c fwd", provider=p, ms=1.0, tflops=t, peak_mib=None, input_mib=None, note="")
            for p, t in (("solution", 300.0), ("op", 400.0), ("sdpa-cudnn", 500.0), ("flex", 200.0))]
    (tmp_path / "rows.json").write_text(json.dumps(dict(device="NVIDIA H200", rows=rows)))
    page = bench_report.render(tmp_path / "rows.json")
    header = next(line for line in page.splitlines() if line.startswith("| case |"))
    assert "op vs sdpa-cudnn" in header and "op vs flex" in header and "solution vs op" not in header
    assert "| c fwd | 300 | 400 | 500 | 200 | 0.60x | 1.50x | 0.80x | 2.00x |" in page


def test_a_file_merged_from_two_runs_says_which_rows_each_made(tmp_path):
    """Rows kept from an earlier run beside a new run's are named on the page (the JSON's ``runs``)."""
    from grader.bench import report as bench_report
    rows = [dict(stage="stage9", case="c fwd", provider="op", ms=1.0, tflops=400.0, peak_mib=None, input_mib=None,
                 note="")]
    runs = ["the dense cases: an earlier run", "the windowed cases: a later run"]
    (tmp_path / "rows.json").write_text(json.dumps(dict(device="NVIDIA H200", runs=runs, rows=rows)))
    page = bench_report.render(tmp_path / "rows.json")
    assert "Runs:\n\n- the dense cases: an earlier run\n- the windowed cases: a later run\n" in page
    (tmp_path / "rows.json").write_text(json.dumps(dict(device="NVIDIA H200", rows=rows)))
    assert "Runs:" not in bench_report.render(tmp_path / "rows.json")


def test_the_notes_ranges_for_the_op_on_the_h200_are_the_committed_bench_s():
    """docs/hopper-notes.md's line on the H200 stage 9 bench gives the ranges of the op's speed that
    docs/bench-stage9-h200.json holds, against each provider timed beside it."""
    rows = json.loads((ROOT / "docs" / "bench-stage9-h200.json").read_text())["rows"]
    get = {(r["case"], r["provider"]): r["tflops"] for r in rows}

    def span(other, having=""):
        ratios = [get[c, "op"] / get[c, other] for c, p in get if p == other and having in c
                  and get.get((c, "op")) and get[c, other]]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert (f"the op at {span('sdpa-cudnn')} cuDNN, {span('sdpa-flash')} FA2, and {span('flex')} FlexAttention "
            f"({span('flex', 'W128 ')} at window 128, {span('flex', 'W1024 ')} at window 1024)") in notes
    ms = {(r["case"], r["provider"]): r["ms"] for r in rows if r["ms"]}
    timed, slower = _rows_cudnn_beats(ms)
    behind = [ms[c, "sdpa-cudnn"] / ms[c, "op"] for c in slower]
    assert (f"cuDNN was faster on {_WORDS[len(slower)]} of the {_WORDS[len(timed)]} dense and GQA rows "
            f"({min(behind):.2f}-{max(behind):.2f}x: {_named(slower)})") in notes
    assert all(" W" not in c for c in timed)
    d128, before = "B4 H16 N4096 D128 fwd", {(r["case"], r["provider"]): r["ms"] for r in
                                              json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"]}
    assert (f"the op's D128 forward took {ms[d128, 'op']:.3f} ms and stage 4's wgmma kernel, which is what the op "
            f"runs there, {ms[d128, 'solution-wgmma']:.3f} ms in its own row (`solution-wgmma`), "
            f"{ms[d128, 'op'] / ms[d128, 'solution-wgmma']:.2f}x apart; in the run before, the op's row was the "
            f"faster by {1 - before[d128, 'op'] / before[d128, 'solution-wgmma']:.0%}") in notes


def test_the_host_table_in_the_notes_is_the_committed_run_s():
    """docs/stage9-notes.md's table of host time per call is what grader/bench/host.py's summary makes
    of docs/bench-host-h200.json, a run with the C++ path built, named with its GPU and versions."""
    from grader.bench import host
    doc = json.loads((ROOT / "docs" / "bench-host-h200.json").read_text())
    notes = (ROOT / "docs" / "stage9-notes.md").read_text()
    lines = host.summary(doc)
    assert doc["native"] and len(lines) == 3 * len(doc["runs"]) >= 6
    assert all(line in notes for line in lines), "\n".join(lines)
    assert _names_its_run(notes, doc)
    python_vs_sdpa = [run[python]["host_us"] / run[sdpa]["host_us"]
                      for run in doc["runs"] for _, _, python, sdpa in host.CALLS]
    span = f"{min(python_vs_sdpa):.1f}-{max(python_vs_sdpa):.1f}"
    assert f"Python path cost {span} times SDPA's" in " ".join(notes.split())


def test_section_11_tables_are_the_committed_probes():
    """docs/hopper-notes.md's section 11: which forward the op's plans picked is what
    grader/bench/probes/op_forward_plans.py's summary makes of its committed JSON, and the op beside
    cuDNN and FlexAttention is the newest run of docs/hopper-probe-op-kernels-h200.json; each names
    its GPU and versions."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 11.")
    plans = json.loads((ROOT / "docs" / "hopper-probe-op-forward-plans-h200.json").read_text())
    lines = _probe("op_forward_plans").summary(plans["rows"])
    assert len(lines) == len(plans["rows"]) >= 10 and all(line in section for line in lines), "\n".join(lines)
    assert _names_its_run(section, plans)
    for r in plans["rows"]:                      # the plan kept the faster of the two it timed
        assert (r["wgmma"] is not None) == (r["forward_ms"]["wgmma"] == min(r["forward_ms"].values())), r
    kernels = json.loads((ROOT / "docs" / "hopper-probe-op-kernels-h200.json").read_text())
    assert _names_its_run(section, kernels)
    for case, of in _op_kernels_run().items():
        timed = "cudnn" in of and of["cudnn"]["fwd_ms"]
        cudnn = f"{of['cudnn']['fwd_tflops']:.0f} / {of['cudnn']['bwd_tflops']:.0f}" if timed else "–"
        vs_cudnn = (f"{of['cudnn']['fwd_ms'] / of['op']['fwd_ms']:.2f}x / "
                    f"{of['cudnn']['bwd_ms'] / of['op']['bwd_ms']:.2f}x") if timed else "–"
        row = (f"| {case} | {cudnn} | {of['flex']['fwd_tflops']:.0f} / {of['flex']['bwd_tflops']:.0f} | "
               f"{of['op']['fwd_tflops']:.0f} / {of['op']['bwd_tflops']:.0f} | "
               f"{of['flex']['fwd_ms'] / of['op']['fwd_ms']:.2f}x / {of['flex']['bwd_ms'] / of['op']['bwd_ms']:.2f}x"
               f" | {vs_cudnn} |")
        assert row in section, row
    rows = json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"]
    get = {(r["case"], r["provider"]): r["tflops"] for r in rows}
    dense = [c for c, p in get if p == "op" and c.endswith("fwd") and " W" not in c]
    ratios = [get[c, "op"] / get[c, "solution-tma"] for c in dense]
    cudnn = [get[c, "op"] / get[c, "sdpa-cudnn"] for c in dense]
    flat = " ".join(section.split())
    assert (f"{min(ratios):.2f}-{max(ratios):.2f}x the TMA forward and {min(cudnn):.2f}-{max(cudnn):.2f}x cuDNN "
            f"on its {len(dense)} forwards without a window") in flat


def test_section_12_tables_are_the_committed_probe():
    """docs/hopper-notes.md's section 12: the one-pass wgmma backward's tables are what
    grader/bench/probes/wgmma_backward.py's summary makes of runs 2 and 3 of its committed JSON,
    the section names the GPU and versions, and its ranges are the JSON's."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 12.")
    doc = json.loads((ROOT / "docs" / "hopper-probe-wgmma-backward-h200.json").read_text())
    assert _names_its_run(section, doc)
    runs = {run["run"]: run for run in doc["runs"]}
    for name in ("2", "3"):
        for line in _probe("wgmma_backward").summary(runs[name]["rows"]):
            assert line in section, line
    assert all(c["error"] < 2e-2 for run in doc["runs"] for c in run["checks"])

    def ratios(run, provider, against="cudnn"):
        of = {(r["case"], r.get("provider_now", r["provider"])): r["bwd_ms"] for r in runs[run]["rows"]}
        return [of[c, against] / of[c, provider] for c, p in of if p == provider]

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}x"
    flat = " ".join(section.split())
    assert f"runs at {span(ratios('2', 'wgmma-leave-out-1'))} cuDNN ({span(ratios('2', 'wgmma-leave-out-2'))}" in flat
    double = ratios("4", "wgmma-2x2-tma2")
    assert f"{span(ratios('4', 'wgmma-2x2-tma2', 'tma'))} the TMA backward, {span(double)}" in flat
    atomic = [r for run in "123" for p in ("wgmma-2x2-atomic", "wgmma-2x3-atomic")
              for r in (ratios(run, p, "tma") if any(x.get("provider_now") == p for x in runs[run]["rows"]) else [])]
    assert f"The atomic variant ties the TMA backward ({span(atomic)} across runs 1-3)" in flat


def test_section_13_tables_are_the_committed_probe():
    """docs/hopper-notes.md's section 13: the dQ writer warp's three tables are what
    grader/bench/probes/wgmma_backward.py's summary makes of its committed JSON, the section names
    the GPU and versions, and the ranges it states are the JSON's."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 13.")
    doc = json.loads((ROOT / "docs" / "hopper-probe-wgmma-backward-writer-h200.json").read_text())
    assert _names_its_run(section, doc)
    runs = {run["run"]: run for run in doc["runs"]}
    for run in runs.values():
        for line in _probe("wgmma_backward").summary(run["rows"]):
            assert line in section, line
    assert all(c["error"] < 2e-2 for run in doc["runs"] for c in run["checks"])
    assert f"{100 * max(c['error'] for run in doc['runs'] for c in run['checks']):.2f}% of the largest" in section

    def ms(run, provider):
        return {r["case"]: r["bwd_ms"] for r in runs[run]["rows"] if r["provider"] == provider}

    def ratios(run, provider, against="cudnn"):
        theirs, ours = ms(run, against), ms(run, provider)
        return [theirs[c] / ours[c] for c in ours]

    def span(values, fmt="{:.2f}"):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"
    flat = " ".join(section.split())
    best = "wgmma-2x2-warp1-early"
    assert f"from {span(ratios('1', 'wgmma-2x2-tma1'))}x cuDNN" in flat
    assert f"to {span(ratios('1', 'wgmma-2x2-warp1'))}x in the same run" in flat
    assert f"took it to {span(ratios('1', best))}x" in flat
    every = [x for run in runs for x in ratios(run, best)]
    every_tma = [x for run in runs for x in ratios(run, best, "tma")]
    assert f"runs at {span(every)}x cuDNN and {span(every_tma)}x the TMA backward" in flat
    d128 = "B4 H16 N4096 D128"
    tflops = {p: [r["bwd_tflops"] for run in doc["runs"] for r in run["rows"]
                  if r["case"] == d128 and r["provider"] == p] for p in ("cudnn", best)}
    assert f"({span(tflops['cudnn'], '{:.0f}')} TFLOP/s on the dense D128 case)" in flat
    assert f"more than this kernel's ({span(tflops[best], '{:.0f}')})" in flat
    assert f"runs at {span(ratios('3', 'wgmma-leave-out-1'))}x cuDNN" in flat
    without, with_ = ms("3", "wgmma-leave-out-1"), ms("3", best)
    cost = [1 - without[c] / with_[c] for c in with_]
    assert f"they take {span([100 * c for c in cost], '{:.0f}')}% of its time" in flat


def test_section_14_tables_are_the_committed_probe():
    """docs/hopper-notes.md's section 14: the one pass with GQA, windows and sinks, its two tables
    from the committed JSON through the probe's summary, and the ranges it states, some set
    against section 13's runs."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 14.")
    doc = json.loads((ROOT / "docs" / "hopper-probe-wgmma-backward-features-h200.json").read_text())
    before = json.loads((ROOT / "docs" / "hopper-probe-wgmma-backward-writer-h200.json").read_text())
    assert _names_its_run(section, doc) and doc["command"] in " ".join(section.split())
    probe = _probe("wgmma_backward")
    for line in probe.summary(doc["rows"]) + probe.summary([r for r in doc["rows"] if "Hkv" in r["case"]], "tma"):
        assert line in section, line
    assert all(c["error"] < 2e-2 for c in doc["checks"]) and len({c.get("case") for c in doc["checks"]}) == 5
    worst = max(c["error"] for c in doc["checks"] if "case" in c)
    flat = " ".join(section.split())
    assert f"largest error {100 * worst:.2f}% of the largest gradient" in flat
    best = "wgmma-2x2-warp1-early"
    ms = {(r["case"], r["provider"]): r["bwd_ms"] for r in doc["rows"]}

    def ratio(case, against):
        return f"{ms[case, against] / ms[case, best]:.2f}x"
    b4, b1 = "B4 N2048 Hq16/Hkv4 D64 sinks", "B1 N4096 Hq64/Hkv8 D64 sinks"
    assert f"{ratio(b4 + ' causal', 'tma')} the TMA backward at B4 N2048 Hq16/Hkv4 causal" in flat
    assert f"{ratio(b4 + ' window 128', 'tma')} under a 128-key window" in flat
    assert f"({ratio(b1 + ' causal', 'tma')} causal, {ratio(b1 + ' window 128', 'tma')} under the window)" in flat
    dense = [f"B4 H16 N4096 D{d}" for d in (64, 128)]
    causal = [c + " causal" for c in dense]
    assert f"{ratio(dense[0], 'cudnn')} and {ratio(dense[1], 'cudnn')} cuDNN without a mask" in flat
    assert f"but {ratio(causal[0], 'cudnn')} and {ratio(causal[1], 'cudnn')} causal" in flat

    def span(values, fmt="{:.2f}"):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"

    def section_13(of):                 # (case, the best's ms, cuDNN's ms) of section 13's runs, for cases ``of``
        for run in before["runs"]:
            mine = {(r["case"], r["provider"]): r["bwd_ms"] for r in run["rows"]}
            yield from ((c, mine[c, best], mine[c, "cudnn"]) for c in of if (c, best) in mine)
    assert f"without a mask ({span([u / t for _, t, u in section_13(dense)])}x in section 13's runs)" in flat
    assert f"causal ({span([u / t for _, t, u in section_13(causal)])}x there)" in flat
    less = [100 * (1 - t / ms[c, best]) for c, t, _ in section_13(causal)]
    assert f"13's kernel took {span(less, '{:.0f}')}% less time on them" in flat


def test_section_15_tables_are_the_committed_probes():
    """docs/hopper-notes.md's section 15: the one pass with its masks as selects and launched longest
    first, its tables from the committed JSON through the probe's summary; the host time of the
    one pass from its probe, the plan's rule set by it, and the training step that showed it."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 15.")
    flat = " ".join(section.split())
    doc = json.loads((ROOT / "docs" / "hopper-probe-wgmma-backward-order-h200.json").read_text())
    assert _names_its_run(section, doc) and doc["command"] in flat
    probe = _probe("wgmma_backward")
    for line in probe.summary(doc["rows"]) + probe.summary([r for r in doc["rows"] if "Hkv" in r["case"]], "tma"):
        assert line in section, line
    worst = max(c["error"] for c in doc["checks"])
    assert worst < 2e-2 and f"largest error {100 * worst:.2f}% of the largest gradient" in flat
    host = json.loads((ROOT / "docs" / "hopper-probe-one-pass-host-h200.json").read_text())
    assert _names_its_run(section, host) and host["native"]
    assert all(line in section for line in _probe("one_pass_host").summary(host["rows"]))
    of = {(r["case"], r["backward"]): r["host_ms"] for r in host["rows"]}
    extra = [of[c, "one pass"] - of[c, "TMA"] for c, b in of if b == "TMA"]
    assert f"cost {min(extra):.2f}-{max(extra):.2f} ms of host time a call" in flat
    plans = load_package(ROOT / "solutions" / "attention_op").plans
    for backward, constant in (("one pass", plans.ONE_PASS_HOST_MS), ("TMA", plans.TMA_HOST_MS)):
        most = max(of[c, b] for c, b in of if b == backward)
        assert f"{most:.2f}" == f"{constant:.2f}" and f"{most:.2f} ms with the {backward}" in flat.replace(
            "with the TMA kernels", "with the TMA")
    # Every choice of section 4's bench run stays: the rule picks the faster of the two there.
    bench = {(r["case"], r["provider"]): r["ms"] for r in
             json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"] if r["ms"]}
    cases = [c for c, p in bench if p == "solution-wgmma" and c.endswith("bwd")]
    for c in cases:
        ms = {"wgmma": bench[c, "solution-wgmma"], "tma": bench[c, "solution-tma"]}
        assert plans.keeps_one_pass(ms) == (ms["wgmma"] < ms["tma"]), c
    current = {(r["case"], r["provider"]): r["ms"] for r in
               json.loads((ROOT / "docs" / "bench-stage9-h200.json").read_text())["rows"] if r["ms"]}
    for c in cases:                                     # and in the pages' current run
        ms = {"wgmma": current[c, "solution-wgmma"], "tma": current[c, "solution-tma"]}
        assert plans.keeps_one_pass(ms) == (ms["wgmma"] < ms["tma"]), c
    faster = [bench[c, "solution-wgmma"] for c in cases if bench[c, "solution-wgmma"] < bench[c, "solution-tma"]]
    assert f"took {min(faster):.2f} ms or more wherever it was faster" in flat
    train = json.loads((ROOT / "docs" / "hopper-probe-train-one-pass-h200.json").read_text())
    step = {r["provider"]: r for r in train["rows"]}
    assert (f"took {step['workbook-compiled']['step_ms']:.2f} ms compiled against FlexAttention's "
            f"{step['flex-compiled']['step_ms']:.2f} ms") in flat
    assert f"({step['workbook-compiled']['host_ms']:.2f} ms to issue a step)" in flat
    rows = json.loads((ROOT / "docs" / "hopper-probe-train-plans-h200.json").read_text())["rows"]
    of = {(r["size"], r["provider"]): r for r in rows}
    op, flex = ((of["b8n1024", p], of["b2n4096", p]) for p in ("workbook-compiled", "flex-compiled"))
    assert (f"took {op[0]['step_ms']:.2f} ms compiled against FlexAttention's {flex[0]['step_ms']:.2f} at "
            f"b8n1024, and {op[1]['step_ms']:.2f} ms against {flex[1]['step_ms']:.2f} at b2n4096") in flat
    assert (f"kernels took {op[0]['attention_ms']:.2f} and {op[1]['attention_ms']:.2f} ms against "
            f"FlexAttention's {flex[0]['attention_ms']:.2f} and {flex[1]['attention_ms']:.2f}") in flat
    for name, lo, hi in (("kernel_ms", "busy for", "ms of"), ("step_ms", "ms of", "ms, with"),
                         ("host_ms", "with", "ms of host time")):
        values = [r[name] for r in (*op, *flex)]
        assert f"{lo} {min(values):.2f}-{max(values):.2f} {hi}" in flat, name
    above = [r for r in rows if r["host_ms"] > r["step_ms"]]
    assert f"above the step time in {len(above)} of the run's {len(rows)} rows" in flat


def test_section_16_tables_are_the_committed_probes():
    """docs/hopper-notes.md's section 16: the prefetching one pass, the timed plans at bench train's
    sizes and gpt-oss's layer through the op, each table from its committed JSON, each run named."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 16.")
    flat = " ".join(section.split())
    docs = {name: json.loads((ROOT / "docs" / f"hopper-probe-{name}-h200.json").read_text())
            for name in ("wgmma-backward-prefetch", "train-tiles", "op-kernels-gptoss")}
    for doc in docs.values():
        assert _names_its_run(section, doc) and doc["command"] in flat
    prefetch = docs["wgmma-backward-prefetch"]
    assert all(line in section for line in _probe("wgmma_backward").summary(prefetch["rows"]))
    worst = max(c["error"] for c in prefetch["checks"])
    assert worst < 2e-2 and f"largest error {100 * worst:.2f}% of the largest gradient" in flat
    of = {(r["case"], r["provider"]): r["bwd_ms"] for r in prefetch["rows"]}
    dense = [c for c, p in of if p == "wgmma-2x2-warp1-early" and "D64" in c]
    lost = []
    for config in ("2x2-warp1-early-prefetch", "2x3-warp1-early-prefetch"):
        slower = [1 - of[c, "wgmma-2x2-warp1-early"] / of[c, "wgmma-" + config] for c in dense]
        assert min(slower) > 0, config                  # slower than the default on every case it ran
        lo, hi = (round(100 * x) for x in (min(slower), max(slower)))
        lost.append(f"{lo}%" if lo == hi else f"{lo}-{hi}%")
    assert (f"With a ring of two stages the kernel loses {lost[0]} of its speed, with three it still loses "
            f"{lost[1]} to the default") in flat
    tiles = docs["train-tiles"]
    assert all(line in section for line in _probe("train_tiles").summary(tiles["rows"]))
    launched = {(r["size"], r["run"]): tuple(sorted(k for k in r["kernels"] if r["kernels"][k] > 0.01))
                for r in tiles["rows"] if r["provider"] != "flex-compiled"}
    assert len({k for (size, _), k in launched.items() if size == "b2n4096"}) == 1    # every run the same kernels
    small = {r["run"]: r for r in tiles["rows"] if r["size"] == "b8n1024"}
    assert launched["b8n1024", "workbook-compiled-timed"] != launched["b8n1024", "workbook-compiled"]
    assert any(k.startswith("void stage4w::") for k in small["workbook-compiled-timed"]["kernels"])
    timed, untimed = small["workbook-compiled-timed"], small["workbook-compiled"]
    assert (f"a dK/dV kernel that took {timed['kernels']['_tma_dkdv_kernel']:.3f} ms a step against "
            f"{untimed['kernels']['_tma_dkdv_kernel']:.3f}") in flat
    flex = small["flex-compiled"]["attention_ms"]
    ratios = (flex / timed["attention_ms"], flex / untimed["attention_ms"])
    assert (f"kernels took {timed['attention_ms']:.3f} ms against {untimed['attention_ms']:.3f}, "
            f"{ratios[0]:.2f}x FlexAttention's against {ratios[1]:.2f}x") in flat
    big = next(r for r in tiles["rows"] if r["size"] == "b2n4096" and r["run"] == "workbook-compiled")
    assert (f"Of the {big['attention_ms']:.2f} ms at b2n4096, the dK/dV kernel took "
            f"{big['kernels']['_tma_dkdv_kernel']:.2f}") in flat
    rows: dict = {}
    for r in docs["op-kernels-gptoss"]["rows"]:
        rows.setdefault(r["case"], {})[r["provider"]] = r
    for case, by in rows.items():
        for p in ("op", "op-bnhd"):
            r, flex = by[p], by["flex"]
            cudnn = (f"{(by['cudnn']['fwd_ms'] + by['cudnn']['bwd_ms']) / (r['fwd_ms'] + r['bwd_ms']):.2f}x"
                     if "cudnn" in by else "–")
            line = (f"| {case} | {p} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {cudnn} | "
                    f"{flex['fwd_ms'] / r['fwd_ms']:.2f}x / {flex['bwd_ms'] / r['bwd_ms']:.2f}x |")
            assert line in section, line
    host = json.loads((ROOT / "docs" / "hopper-probe-compiled-host-h200.json").read_text())
    assert _names_its_run(section, host) and host["command"] in flat
    b, n, hq, hkv, d = host["shape"]
    assert f"(B{b} N{n} Hq{hq}/Hkv{hkv} D{d}, causal, learned sinks, `bnhd`)" in section.replace("\n", " ")
    table = _probe("compiled_host").summary(host["rows"])
    assert len(table) == 2 + 4 and all(line in section for line in table)
    per = {line.split(" | ")[0][2:]: int(line.split(" | ")[3]) for line in table[2:]}
    assert per["op"] < per["flex"] and "In this run a call of the op cost the host less than FlexAttention's" in flat


def test_section_17_compares_the_two_plans_each_from_its_run():
    """docs/hopper-notes.md's section 17: bench train at b8n1024 with every plan timed and with the
    Triton tiles alone timed, each row from its run's JSON, and the rule the op keeps."""
    from kernels import tuning
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 17.")
    flat = " ".join(section.split())
    plans = load_package(ROOT / "solutions" / "attention_op").plans
    assert plans.TUNE_WORK == 8 * 8 * 1024 * 1024 and 1024 * 1024 < tuning.TUNE_FROM
    for label, name in (("every kernel timed, the wgmma ones too", "hopper-probe-train-timed-wgmma-h200.json"),
                        ("Triton tiles timed, as kept", "hopper-probe-train-plans-h200.json")):
        doc = json.loads((ROOT / "docs" / name).read_text())
        assert _names_its_run(section, doc) and f"({name})" in section
        of = {r["provider"]: r for r in doc["rows"] if r["size"] == "b8n1024"}
        op, flex = of["workbook-compiled"], of["flex-compiled"]
        assert (f"| {label} | {op['attention_ms']:.3f} | {flex['attention_ms']:.3f} | {op['step_ms']:.2f} | "
                f"{flex['step_ms']:.2f} | {flex['step_ms'] / op['step_ms']:.2f}x |") in section
    kept = {r["provider"]: r for r in
            json.loads((ROOT / "docs" / "hopper-probe-train-plans-h200.json").read_text())["rows"]
            if r["size"] == "b8n1024"}
    assert f"the GPU was busy {kept['workbook-compiled']['kernel_ms']:.2f} ms of the op's " \
           f"{kept['workbook-compiled']['step_ms']:.2f}" in flat


def test_the_one_pass_step_of_the_hopper_path_is_the_committed_bench_s():
    """The list of steps from stage 9 to the Hopper path gives the one pass's gain over the TMA
    backward, and its speed against cuDNN, from the stage 9 bench run that timed them together."""
    rows = json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"]
    ms = {(r["case"], r["provider"]): r["ms"] for r in rows if r["ms"]}
    cases = [c for c, p in ms if p == "op" and c.endswith("bwd") and " W" not in c]
    tma = [ms[c, "solution-tma"] / ms[c, "op"] for c in cases]
    cudnn = [ms[c, "sdpa-cudnn"] / ms[c, "op"] for c in cases]
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert (f"{min(tma):.2f}-{max(tma):.2f}x the TMA backward on the stage 9 bench's backwards without a window, "
            f"{min(cudnn):.2f}-{max(cudnn):.2f}x cuDNN, in the same run") in notes


def test_the_compiled_host_probe_takes_one_call_as_the_difference_of_two_chains(capsys):
    """compiled_host.py's table: a provider's µs a call is its chain's host time at the two lengths,
    the difference over the difference in calls; FlexAttention's over it; a provider timed at one
    length only has no row; without a GPU it says so."""
    probe = _probe("compiled_host")
    lo, hi = probe.LAYERS
    rows = [dict(provider=p, layers=n, host_ms=ms) for p, n, ms in (
        ("op", lo, 1.0), ("op", hi, 1.0 + 0.06 * (hi - lo)), ("flex", lo, 0.9), ("flex", hi, 0.9 + 0.03 * (hi - lo)),
        ("op-static", lo, 2.0))]
    assert probe.summary(rows)[0].startswith(f"| provider | host ms, chain of {lo} | host ms, chain of {hi} |")
    assert probe.summary(rows)[2:] == [f"| op | 1.000 | {1.0 + 0.06 * (hi - lo):.3f} | 60 | 0.50x |",
                                       f"| flex | 0.900 | {0.9 + 0.03 * (hi - lo):.3f} | 30 | 1.00x |"]
    assert [p for p, _, _ in probe.PROVIDERS].count("flex") == 1
    if not runtime.ON_GPU:
        assert probe.main([]) == 2 and "compiles for a CUDA GPU" in capsys.readouterr().err


def test_the_train_tiles_probe_compares_each_run_with_flexattention_of_its_size(capsys):
    """train_tiles.py's last table divides FlexAttention's attention kernel time by each run's of the
    same size; its sizes are bench train's, an unknown one is named; without a GPU it says so."""
    probe = _probe("train_tiles")
    rows = [dict(size=s, run=r, tune_from=t, host_ms=2.0, attention_ms=ms) for s, r, t, ms in (
        ("a", "flex-compiled", 4, 0.6), ("a", "workbook-compiled", 4, 0.5), ("a", "workbook-compiled-timed", 1, 0.4),
        ("b", "workbook-compiled", 4, 1.0))]
    assert probe.summary(rows)[2:] == ["| a | flex-compiled | 4 | 2.00 | 0.600 | 1.00x |",
                                       "| a | workbook-compiled | 4 | 2.00 | 0.500 | 1.20x |",
                                       "| a | workbook-compiled-timed | 1 | 2.00 | 0.400 | 1.50x |",
                                       "| b | workbook-compiled | 4 | 2.00 | 1.000 | - |"]
    assert {p for _, p, _, _ in probe.RUNS} <= set(probe.bench_train.PROVIDERS)
    assert {k for _, _, _, k in probe.RUNS} <= {"auto", "tma"}
    with pytest.raises(SystemExit):
        probe.main(["--sizes", "b8n1024,huge"])
    assert "--sizes: unknown 'huge'" in capsys.readouterr().err
    if not runtime.ON_GPU:
        assert probe.main(["--sizes", "b8n1024"]) == 2 and "trains on a CUDA GPU" in capsys.readouterr().err


def test_section_18_table_is_the_committed_probe_and_its_ranges_hold():
    """docs/hopper-notes.md's section 18: step_parts.py's table from its committed JSON, and the
    ranges the text draws from it (pipelined host time and kernel time against the step time)."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 18.")
    flat = " ".join(section.split())
    doc = json.loads((ROOT / "docs" / "hopper-probe-step-parts-h200.json").read_text())
    assert _names_its_run(section, doc) and doc["command"] in flat
    table = _probe("step_parts").summary(doc["rows"])
    assert len(table) == 2 + 6 and all(line in section for line in table)
    rows = doc["rows"]
    pipelined = [r["pipelined_ms"] / r["step_ms"] for r in rows]
    kernels = [r["kernel_ms"] / r["step_ms"] for r in rows]
    assert min(pipelined) > 0.9 > max(kernels) and all(r["spin_outlasted"] for r in rows)
    assert (f"the host took {min(pipelined):.2f}-{max(pipelined):.2f}x the step time to issue a step pipelined, "
            f"while the step's kernels kept the GPU busy for {min(kernels):.2f}-{max(kernels):.2f}x of it") in flat
    for r in rows:
        assert abs(r["alone_ms"] - sum(r["parts_ms"].values())) < 1e-2, r
    of = {(r["size"], r["provider"]): r for r in rows}
    for size, more in (("b8n1024", True), ("b2n4096", False)):
        op, flex = of[size, "workbook-compiled"]["parts_ms"], of[size, "flex-compiled"]["parts_ms"]
        assert (op["forward"] + op["backward"] > flex["forward"] + flex["backward"]) == more, size
    here = of["b8n1024", "workbook-compiled"]["step_ms"], of["b8n1024", "flex-compiled"]["step_ms"]
    train = {(r["size"], r["provider"]): r for r in
             json.loads((ROOT / "docs" / "hopper-probe-train-plans-h200.json").read_text())["rows"]}
    there = train["b8n1024", "workbook-compiled"]["step_ms"], train["b8n1024", "flex-compiled"]["step_ms"]
    assert (f"took {here[0]:.2f} ms at b8n1024 here and {there[0]:.2f} ms in section 15's run, "
            f"FlexAttention's {here[1]:.2f} and {there[1]:.2f}") in flat


def _train_rows(name: str) -> dict:
    return {(r["size"], r["provider"]): r for r in json.loads((ROOT / "docs" / name).read_text())["rows"]}


def test_section_19_table_is_the_committed_probe_and_its_tile_is_planned():
    """docs/hopper-notes.md's section 19: the window forward's tiles from their committed JSON, the
    tile it adds to the TMA forward's table (not as the untimed first entry), and the rate that 1.5x
    FlexAttention at window 1024 would take, against the stage 9 bench's dense forwards."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 19.")
    flat = " ".join(section.split())
    doc = json.loads((ROOT / "docs" / "hopper-probe-window-forward-tiles-h200.json").read_text())
    assert _names_its_run(section, doc)
    table = _probe("window_forward_tiles").summary(doc["rows"])
    assert len(table) == 2 + 8 and all(line in section for line in table)
    after = [r for r in doc["rows"] if r["run"] == "narrow, tile in the table" and r["provider"] == "tma autotuned"]
    assert len(after) == 2 and all(r["tile"] == "128/32/4w/3s" for r in after)
    ms = {(r["run"], r["case"], r["provider"], r["tile"]): r["ms"] for r in doc["rows"] if r.get("ms")}
    w128 = {t: v for (run, case, p, t), v in ms.items()
            if run == "all tiles" and case == "B4 Hq32/Hkv8 N8192 D64 W128" and p == "tma tile"}
    assert min(w128, key=w128.get) == "128/32/4w/3s"
    tma = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    assert (128, 32, 4, 3) in tma.TMA_TILES[64] and tma.TMA_TILES[64][0] == (128, 64, 4, 3)
    for window, worst in ((128, 1.47), (1024, 1.21)):
        case = f"B4 Hq32/Hkv8 N8192 D64 W{window}"
        times = {t: v for (run, c, p, t), v in ms.items() if run == "all tiles" and c == case and p == "tma tile"}
        tall = [v / min(times.values()) for t, v in times.items() if int(t.split("/")[0]) > 128]
        assert f"{min(tall):.2f}" == f"{worst:.2f}", window
    # The fourth run: one masked loop against two, and the rule ONE_LOOP_WINDOW draws from it.
    loops = _probe("window_forward_tiles").one_loop_summary([r for r in doc["rows"] if r["run"] == "one loop"])
    assert len(loops) == 2 + 12 and all(line in section for line in loops)
    speed = {(case, tile): ms["one loop", case, "tma tile, two loops", tile] / v
             for (run, case, p, tile), v in ms.items() if run == "one loop" and p == "tma tile, one loop"}
    assert tma.ONE_LOOP_WINDOW == 128 and tma.one_loop(128) and not tma.one_loop(129) and not tma.one_loop(None)
    assert all(s < 1 for (case, _), s in speed.items() if "W1024" in case)
    assert all(s > 1 for (case, tile), s in speed.items() if "W128" in case and tile == "128/32/4w/3s")
    w128 = [v for (case, tile), v in speed.items() if "W128" in case and tile.startswith("128/")]
    assert f"ran {min(w128):.2f}-{max(w128):.2f}x as fast with the 128-row tiles" in flat
    w1024 = [v for (case, _), v in speed.items() if "W1024" in case]
    assert f"one loop ran at {min(w1024):.2f}-{max(w1024):.2f}x the two loops' speed" in flat
    tuned, flex128, tuned_sinks, flex_sinks = (ms["one loop", f"B4 Hq32/Hkv8 N8192 D64 W128{s}", p, tile]
                                               for s in ("", " sinks")
                                               for p, tile in (("tma autotuned", "128/32/4w/3s"), ("flex", "")))
    sinks = flex_sinks / tuned_sinks
    assert (f"took {tuned:.3f} ms against FlexAttention's {flex128:.3f}, {flex128 / tuned:.2f}x, and {sinks:.2f}x "
            f"with learned sinks") in flat
    flex = ms["all tiles", "B4 Hq32/Hkv8 N8192 D64 W1024", "flex", ""]
    flops = 4 * 4 * 32 * 64 * sum(min(i + 1, 1024) for i in range(8192))
    bench = {(r["case"], r["provider"]): r["tflops"] for r in
             json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"] if r["ms"]}
    assert (f"FlexAttention's {flex:.3f} ms / 1.5 = {flex / 1.5:.3f} ms, {flops / (flex / 1.5) / 1e9:.0f} TFLOP/s "
            f"of the {flops:.2e} FLOPs".replace("e+", "e")) in flat
    assert f"dense causal D64 forward ({bench['B4 H16 N4096 D64 causal fwd', 'sdpa-cudnn']:.0f} TFLOP/s" in flat
    assert f"dense forward without a mask ({bench['B4 H16 N4096 D64 fwd', 'sdpa-cudnn']:.0f})" in flat
    dense_flex, dense_op = bench["B4 H16 N4096 D64 fwd", "flex"], bench["B4 H16 N4096 D64 fwd", "op"]
    assert (f"runs at {flops / flex / 1e9:.0f} TFLOP/s, {flops / flex / 1e9 / dense_flex:.2f}x its own dense "
            f"forward ({dense_flex:.0f} in that bench run); 1.5x it would ask the op for "
            f"{flops / (flex / 1.5) / 1e9 / dense_op:.2f}x of its dense rate ({dense_op:.0f})") in flat


def _training_table(of: dict) -> list[str]:
    """Sections 20's and 23's table rows: per size, the op's compiled step and attention kernels
    against FlexAttention's, and its step against cuDNN's, from a bench train JSON's rows."""
    return [f"| {s} | {o['step_ms']:.2f} | {f['step_ms']:.2f} | {f['step_ms'] / o['step_ms']:.2f}x | "
            f"{o['attention_ms']:.2f} | {f['attention_ms']:.2f} | {f['attention_ms'] / o['attention_ms']:.2f}x | "
            f"{c['step_ms'] / o['step_ms']:.2f}x |"
            for s in ("b8n1024", "b2n4096", "large")
            for o, f, c in [[of[s, p] for p in ("workbook-compiled", "flex-compiled", "cudnn-compiled")]]]


def test_section_20_is_its_kept_training_run():
    """docs/hopper-notes.md's section 20 table is its run's, kept beside the latest
    (docs/hopper-probe-train-narrow-tile-h200.json)."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 20.")
    doc = json.loads((ROOT / "docs" / "hopper-probe-train-narrow-tile-h200.json").read_text())
    assert _names_its_run(section, doc) and "hopper-probe-train-narrow-tile-h200.json" in section
    of = _train_rows("hopper-probe-train-narrow-tile-h200.json")
    assert all(line in section for line in _training_table(of))
    large_op, large_flex = of["large", "workbook-compiled"], of["large", "flex-compiled"]
    assert (f"kept the GPU busy {large_op['kernel_ms']:.2f} ms of the op's {large_op['step_ms']:.2f}"
            in " ".join(section.split()))
    assert large_flex["step_ms"] / large_op["step_ms"] >= 1.0 and large_flex["attention_ms"] / large_op[
        "attention_ms"] >= 1.3


def test_what_follows_weighs_the_window_1024_backward_target_against_the_dense_rates():
    """"What follows" puts the rate that 1.5x FlexAttention's window-1024 backward asks for beside
    the op's dense D64 backward rates, all from docs/bench-stage9-h200.json."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    follows = " ".join(_section(notes + "\n## end", "## What follows").split())
    rows = json.loads((ROOT / "docs" / "bench-stage9-h200.json").read_text())["rows"]
    rate = {(r["case"], r["provider"]): r["tflops"] for r in rows}
    need = 1.5 * rate["B4 Hq32/Hkv8 N8192 D64 W1024 bwd", "flex"]
    causal, dense = rate["B4 H16 N4096 D64 causal bwd", "op"], rate["B4 H16 N4096 D64 bwd", "op"]
    assert need > rate["B4 Hq32/Hkv8 N8192 D64 W1024 bwd", "op"]
    assert (f"asks the op for {need:.0f} TFLOP/s of the case's visible pairs: {need / causal:.2f}x the rate of its "
            f"dense causal D64 backward ({causal:.0f}) and {need / dense:.2f}x that of its dense one ({dense:.0f})"
            ) in follows


def test_section_23_and_the_pages_figures_are_the_committed_runs():
    """docs/hopper-notes.md's section 23: the probe's table and ranges from its JSON, the training
    table from docs/bench-train-h200.json, and the training figures sections 4 and "What follows"
    quote are that run's, section 20's and section 15's."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 23.")
    flat = " ".join(section.split())
    probe = json.loads((ROOT / "docs" / "hopper-probe-compiled-descriptors-h200.json").read_text())
    assert _names_its_run(section, probe) and probe["command"] in flat
    assert all(line in section for line in _probe("compiled_descriptors").summary(probe["rows"]))
    get = {(r["case"], r["form"]): r for r in probe["rows"]}
    assert all(r["err"] == 0 for r in probe["rows"])

    def speed(case, key):
        return get[case, "kernel"][key] / get[case, "graph"][key]
    forward = [speed(c, "forward_kernels_ms") for c, f in get if f == "graph" and "W1024" not in c]
    both = [speed(c, "both_kernels_ms") for c, f in get if f == "graph" and "W1024" not in c]
    assert f"take {min(forward):.2f}-{max(forward):.2f}x off the windowed forward's kernels" in flat
    assert f"and {min(both):.2f}-{max(both):.2f}x off forward plus backward at window 128" in flat
    layers = [(get[c, "graph"]["forward_ms"], get[c, "kernel"]["forward_ms"]) for c, f in get
              if f == "graph" and c.startswith("train")]
    graph, kernel = zip(*layers)
    assert (f"a forward took {min(graph):.2f}-{max(graph):.2f} ms with the graph making the descriptors against "
            f"{min(kernel):.2f}-{max(kernel):.2f} ms without") in flat
    doc = json.loads((ROOT / "docs" / "bench-train-h200.json").read_text())
    assert _names_its_run(section, doc)
    of = _train_rows("bench-train-h200.json")
    sizes = ("b8n1024", "b2n4096", "large")
    assert {s for s, _ in of} == set(sizes)
    assert all(line in section for line in _training_table(of))
    op, flex = ([of[s, p] for s in sizes] for p in ("workbook-compiled", "flex-compiled"))
    kernels = [f["attention_ms"] / o["attention_ms"] for o, f in zip(op, flex)]
    steps = [f["step_ms"] / o["step_ms"] for o, f in zip(op, flex)]
    assert all(k >= 1.3 for k in kernels) and "now run past the 1.3x mark at every size" in flat
    assert steps[2] >= 1.0 and max(steps[:2]) < 1.0 and "past FlexAttention's at `large` only" in flat
    old = _train_rows("hopper-probe-train-narrow-tile-h200.json")
    was = [old[s, "flex-compiled"]["attention_ms"] / old[s, "workbook-compiled"]["attention_ms"] for s in sizes]
    assert "where section 20's run had them at {:.2f}x, {:.2f}x and {:.2f}x".format(*was) in flat
    flat_notes = " ".join(notes.split())
    assert (f"attention kernels took {op[0]['attention_ms']:.2f}, {op[1]['attention_ms']:.2f} and "
            f"{op[2]['attention_ms']:.2f} ms per step at b8n1024, b2n4096 and large, against FlexAttention's "
            f"{flex[0]['attention_ms']:.2f}, {flex[1]['attention_ms']:.2f} and {flex[2]['attention_ms']:.2f}"
            ) in flat_notes
    before = [old[s, p]["attention_ms"] for p in ("workbook-compiled", "flex-compiled") for s in sizes]
    assert "in section 20's run they took {:.2f}, {:.2f} and {:.2f} against {:.2f}, {:.2f} and {:.2f}".format(
        *before) in flat_notes
    plans = _train_rows("hopper-probe-train-plans-h200.json")
    before = [plans[s, p]["attention_ms"] for p in ("workbook-compiled", "flex-compiled") for s in sizes[:2]]
    assert "in section 15's run they took {:.2f} and {:.2f} against {:.2f} and {:.2f}".format(*before) in flat_notes
    follows = " ".join(_section(notes + "\n## end", "## What follows").split())
    assert "ran {:.2f}x, {:.2f}x and {:.2f}x as fast as FlexAttention's".format(*kernels) in follows
    assert "its compiled step {:.2f}x, {:.2f}x and {:.2f}x FlexAttention's".format(*steps) in follows
    was = [plans[s, "flex-compiled"]["step_ms"] / plans[s, "workbook-compiled"]["step_ms"] for s in sizes[:2]]
    assert "the op's step was {:.2f}x and {:.2f}x in section 15's run".format(*was) in follows
    launch = (ROOT / "solutions" / "attention_op" / "launch.py").read_text()
    assert "launch is op_launch and _graph_descriptors()" in launch
    library = (ROOT / "solutions" / "attention_op" / "library.py").read_text()
    assert library.count("launch=op_launch") == 2 and "wrap_triton" not in library.split('"""', 2)[2]


def test_section_21_the_backwards_kernels_are_the_committed_probe():
    """docs/hopper-notes.md's section 21: each kernel of a one-pass call against cuDNN's, before and
    after dQ's own conversion kernel, from the committed JSON; the op and the fast path call it."""
    notes = (ROOT / "docs" / "hopper-notes.md").read_text()
    section = _section(notes, "## 21.")
    flat = " ".join(section.split())
    doc = json.loads((ROOT / "docs" / "hopper-probe-backward-parts-h200.json").read_text())
    assert _names_its_run(section, doc) and doc["command"] in flat
    table = _probe("backward_parts").summary([r for r in doc["rows"] if "N4096" in r["case"]])
    assert len(table) == 2 + 16 and all(line in section for line in table)
    by: dict = {}
    for r in doc["rows"]:
        by.setdefault((r["run"], r["case"]), {})[r["provider"]] = r
    main = [v["cudnn"]["main_ms"] / v["one-pass"]["main_ms"] for (run, _), v in by.items() if run == "permuted copy"]
    assert len(main) == 16 and f"ran at {min(main):.2f}-{max(main):.2f}x the speed of cuDNN's main kernel" in flat

    def kernel(run, case, provider, name):
        found = [ms for k, ms in by[run, case][provider]["kernels"].items() if name in k]
        assert len(found) == 1, (run, case, provider, name)
        return found[0]
    d128, d64 = "B4 H16 N4096 D128", "B4 H16 N4096 D64"
    twice = [v["one-pass"]["other_ms"] / v["cudnn"]["other_ms"] for (run, c), v in by.items()
             if run == "permuted copy" and "N4096" in c]
    assert all(1.9 < x < 2.2 for x in twice) and "the other kernels of a call took twice cuDNN's time" in flat
    copy = [kernel("permuted copy", c, "one-pass", "elementwise_kernel") for c in (d128, d64)]
    theirs = [kernel("permuted copy", c, "cudnn", "convert_dq") for c in (d128, d64)]
    assert f"{copy[0]:.3f} ms at D128 and {copy[1]:.3f} at D64" in flat
    assert f"conversion of its float32 dQ took {theirs[0]:.3f} and {theirs[1]:.3f}" in flat
    ours = [kernel("rows kernel", c, "one-pass", "rows_kernel") for c in (d128, d64)]
    assert f"It took {ours[0]:.3f} ms at D128 and {ours[1]:.3f} at D64" in flat
    other = by["rows kernel", d128]
    assert f"({other['one-pass']['other_ms']:.3f} ms against {other['cudnn']['other_ms']:.3f} at D128)" in flat
    calls = [v["cudnn"]["ms"] / v["one-pass"]["ms"] for (run, c), v in by.items()
             if run == "rows kernel" and "N4096" in c]
    assert f"ran {min(calls):.2f}-{max(calls):.2f}x cuDNN's in the second run" in flat
    moved = [by[run, d64]["one-pass"]["main_ms"] for run in ("permuted copy", "rows kernel")]
    assert f"moved from {moved[0]:.3f} ms to {moved[1]:.3f}" in flat
    launch = (ROOT / "solutions" / "attention_op" / "launch.py").read_text()
    assert "wgmma_backward.rows(" in launch and "rows_of_fragments(" not in launch


def test_section_21_gpt_oss_layer_is_the_committed_rerun():
    """Section 21's gpt-oss table is the committed rerun's JSON, in section 16's form, and the kernels
    it names are the ones the run recorded."""
    section = _section((ROOT / "docs" / "hopper-notes.md").read_text(), "## 21.")
    flat = " ".join(section.split())
    doc = json.loads((ROOT / "docs" / "hopper-probe-op-kernels-gptoss-rows-h200.json").read_text())
    assert _names_its_run(section, doc) and doc["command"] in flat
    rows: dict = {}
    for r in doc["rows"]:
        rows.setdefault(r["case"], {})[r["provider"]] = r
    vs_cudnn = {}
    for case, by in rows.items():
        for p in ("op", "op-bnhd"):
            r, flex = by[p], by["flex"]
            cudnn = "–"
            if "cudnn" in by:
                vs_cudnn[p] = (by["cudnn"]["fwd_ms"] + by["cudnn"]["bwd_ms"]) / (r["fwd_ms"] + r["bwd_ms"])
                cudnn = f"{vs_cudnn[p]:.2f}x"
            line = (f"| {case} | {p} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {cudnn} | "
                    f"{flex['fwd_ms'] / r['fwd_ms']:.2f}x / {flex['bwd_ms'] / r['bwd_ms']:.2f}x |")
            assert line in section, line
            assert ("one-pass backward" in r["note"]) == ("full causal" in case), r["note"]
    assert vs_cudnn["op"] >= 1.0 and vs_cudnn["op-bnhd"] >= 1.0
    assert f"{vs_cudnn['op']:.2f}x with `bhnd` tensors and {vs_cudnn['op-bnhd']:.2f}x with `bnhd`" in flat


def test_section_22_host_made_descriptors_are_the_committed_runs():
    """docs/hopper-notes.md's section 22: the probe's forward times with descriptors made in the
    kernel and on the host, the windowed rows of the stage 9 bench after the change, and the
    window-1024 backward's kernels, each from its committed JSON; the kernels take the descriptors
    so made where the op launches them eagerly, and make their own under torch.compile."""
    section = _section((ROOT / "docs" / "hopper-notes.md").read_text(), "## 22.")
    flat = " ".join(section.split())
    rows = json.loads((ROOT / "docs" / "hopper-probe-host-descriptors-h200.json").read_text())
    get = {(r["case"], r["variant"]): r for r in rows}
    assert all(r.get("err", 0.0) < 1e-2 for r in rows)      # every variant computed the forward's output
    for case, tile in (("W128", "128/32/4w/3s"), ("W128 sinks", "128/32/4w/3s"), ("W1024", "128/64/4w/3s")):
        ms = [get[case, f"{tile} {v}"]["ms"] for v in ("x1", "x2", "x4", "x1 host", "x2 host")]
        flex = get[case, "flex"]["ms"]
        line = (f"| B4 Hq32/Hkv8 N8192 D64 {case} | {tile} | " + " | ".join(f"{m:.4f}" for m in ms)
                + f" | {flex:.4f} | {flex / ms[3]:.2f}x |")
        assert line in section, line
    w128, w1024 = (get[c, f"{t} x1"]["ms"] / get[c, f"{t} x1 host"]["ms"]
                   for c, t in (("W128", "128/32/4w/3s"), ("W1024", "128/64/4w/3s")))
    assert 1.2 < w128 < 1.3 and f"0.239 ms to 0.194) and {w1024 - 1:.0%} off window 1024's" in flat
    notes = " ".join((ROOT / "docs" / "hopper-notes.md").read_text().split())
    assert f"{w128:.2f}x as fast as with descriptors made in the kernel, the window-1024 one's {w1024:.2f}x" in notes
    bench = json.loads((ROOT / "docs" / STAGE9_RUNS_21_22).read_text())["rows"]
    tflops = {(r["case"], r["provider"]): r["tflops"] for r in bench}
    for w, sinks in ((128, ""), (128, " sinks"), (1024, ""), (1024, " sinks")):
        c = f"B4 Hq32/Hkv8 N8192 D64 W{w}{sinks}"
        fwd, bwd = (tflops[c + d, "op"] / tflops[c + d, "flex"] for d in (" fwd", " bwd"))
        op, tma, wgmma = (tflops[c + " bwd", p] for p in ("op", "solution-tma", "solution-wgmma"))
        which = "TMA" if abs(op - tma) < abs(op - wgmma) else "one pass"
        assert f"| {c} | {fwd:.2f}x | {bwd:.2f}x | {which} |" in section
        assert (which == "TMA") == (w == 128) and (fwd >= 1.5 and bwd >= 1.5 if w == 128 else True)
    parts = {r["kernel"]: r["ms"] for r in rows if r["case"] == "W1024 bwd" and r["variant"] == "op kernel"}
    named = {"backward_kernel": "the one pass", "rows_kernel": "dQ into rows", "_bwd_preprocess_kernel":
             "stage 9's preprocess", "Memset": "zeroing dQ's float32 buffer"}
    for key, name in named.items():
        assert f"{name} {next(ms for k, ms in parts.items() if key in k):.3f} ms" in flat
    share = 1 - next(ms for k, ms in parts.items() if "backward_kernel" in k) / sum(parts.values())
    op, flex = get["W1024 bwd", "op"]["ms"], get["W1024 bwd", "flex"]["ms"]
    assert f"take {share:.0%} of the kernels' time; 1.5x FlexAttention's {flex:.3f} ms" in flat
    assert f"asks for {flex / 1.5:.3f} ms, against the op's {op:.3f}" in flat
    launch = (ROOT / "solutions" / "attention_op" / "launch.py").read_text()
    assert launch.count("HOST_DESC=bool(made)") == 3
    assert "return launch is _direct or isinstance(launch, _Launch)" in launch
