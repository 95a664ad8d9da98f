"""``python -m grader bench train`` (grader/bench/train.py): what runs without a GPU.

The timings themselves need a GPU; here: the command line refuses what it cannot do, the batches
are the same for every provider, the model trains on the CPU with SDPA, the providers take turns
in rounds of timed steps, the loss-curve check catches a disagreement, and the JSON merge keeps
other sizes' rows.
"""

import json

from kernels import runtime

import pytest
import torch

from grader.__main__ import main as cli
from grader.bench import train as bench_train


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "huge"], "unknown size or provider 'huge'"),
    (["--providers", "flash3"], "unknown size or provider 'flash3'"),
    (["--steps", "0"], "--steps and --warmup must be at least 1"),
])
def test_bad_arguments(capsys, argv, words):
    assert cli(["bench", "train", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.skipif(runtime.ON_GPU, reason="checks the message given where no GPU is visible")
def test_no_gpu_message(capsys):
    assert cli(["bench", "train"]) == 2
    assert "times training steps on a CUDA GPU" in capsys.readouterr().err


def test_batches_repeat_a_phrase_and_are_reproducible():
    size = bench_train.Size("t", 2, 100, 32, 2, 4, 2, head_dim=16, vocab=50)
    first, second = bench_train.batches(size, 3, "cpu"), bench_train.batches(size, 3, "cpu")
    for (t1, y1), (t2, y2) in zip(first, second):
        assert torch.equal(t1, t2) and torch.equal(y1, y2)
    tokens, targets = first[0]
    assert tokens.shape == targets.shape == (2, 100)
    assert torch.equal(tokens[:, 64:], tokens[:, :36]) and torch.equal(tokens[:, 1:], targets[:, :-1])


def test_decoder_trains_on_cpu_with_sdpa():
    size = bench_train.Size("t", 2, 64, 32, 2, 4, 2, head_dim=16, vocab=40, window=8)
    torch.manual_seed(0)
    model = bench_train.Decoder(size, bench_train._sdpa_attend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = bench_train.batches(size, 1, "cpu")[0]
    losses = []
    for _ in range(5):
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(40.0)).item()) < 0.5     # starts near uniform
    assert losses[-1] < losses[0]
    assert [b.attn.window for b in model.blocks] == [8, None]               # alternating, as gpt-oss


def test_flex_provider_is_the_reference_attention_with_window_and_sinks():
    """The FlexAttention provider's layer (block masks, learned sinks through its lse) on the CPU."""
    import warnings

    from kernels import reference
    size = bench_train.Size("t", 1, 256, 32, 2, 4, 2, head_dim=16, vocab=40, window=128)
    attend = bench_train._flex_attend(size, "cpu")
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 256, 4, 16), torch.randn(1, 256, 2, 16), torch.randn(1, 256, 2, 16)

    class Layer:
        sinks = torch.randn(4)

    for window in (128, None):
        Layer.window = window
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # flex without torch.compile: unfused, fine at this size
            o = attend(q, k, v, Layer)
        ref, _ = reference.attention(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True, window=window,
                                     sinks=Layer.sinks)
        assert (o.transpose(1, 2).double() - ref).abs().max() < 1e-4, window


def _row(size, provider, losses):
    return dict(size=size, provider=provider, step_ms=1.0, tokens_per_s=1, peak_mib=1, losses=losses)


def test_agreement_flags_a_wrong_curve():
    good = [_row("s", p, [10.0, 9.0, 8.0]) for p in bench_train.SAME_MODEL]
    assert bench_train.agreement(good)["s"] == 0.0
    bad = good[:2] + [_row("s", "flex-compiled", [10.0, 9.0, 9.0])]
    assert bench_train.agreement(bad)["s"] > bench_train.LOSS_RTOL
    assert "DISAGREE" in bench_train.table(bad, bench_train.agreement(bad))


@pytest.mark.skipif(not runtime.ON_GPU, reason="write_json records the GPU's name")
def test_json_merges_other_sizes(tmp_path):
    path = tmp_path / "t.json"
    bench_train.write_json([_row("a", "workbook", [1.0])], {"a": 0.0}, str(path))
    bench_train.write_json([_row("b", "workbook", [1.0])], {"b": 0.0}, str(path))
    doc = json.loads(path.read_text())
    assert [r["size"] for r in doc["rows"]] == ["a", "b"] and set(doc["loss_gap"]) == {"a", "b"}


def test_the_training_page_is_what_bench_report_makes_of_the_json(tmp_path):
    """docs/training.md is generated from docs/bench-train-h100.json, never typed: it cannot drift; and
    the page says which sizes' loss curves disagree."""
    from kernels.loader import ROOT

    from grader.bench import report
    for page, record in (("training.md", "bench-train-h100.json"), ("training-h200.md", "bench-train-h200.json")):
        assert (ROOT / "docs" / page).read_text() == report.render(ROOT / "docs" / record)
    rows = [_row("s", p, [2.0, 1.0 + (0.5 if p == "workbook" else 0)]) for p in bench_train.SAME_MODEL]
    doc = dict(gpu="GPU X", torch="t", loss_rtol=0.02, loss_gap=bench_train.agreement(rows), rows=rows)
    path = tmp_path / "train.json"
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    page = (tmp_path / "t.md").read_text()
    assert "- machine: GPU X" in page and "| s | workbook | 1.00 | - | - | - | 1 | 1 | 1.00x | 2.000 | 1.500 |" in page
    assert "the step waits on the host" not in page                          # nothing measured, nothing said
    assert "- s: workbook, workbook-compiled, flex-compiled DISAGREE (largest relative gap 33.33%)" in page
    assert "The most any attention kernel could gain" not in page
    doc["rows"].append({**_row("s", "attention-free", [2.0, 2.0]), "step_ms": 0.8})
    doc["rows"][2]["step_ms"] = 1.2                                            # flex-compiled
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    assert "could gain in this model" in (page := (tmp_path / "t.md").read_text()) and "- s: 1.50x" in page
    assert "in kernel time" not in page
    doc["rows"][0].update(host_ms=0.9, kernel_ms=0.5, attention_ms=0.125)   # what a run now writes
    doc["rows"][2]["kernel_ms"], doc["rows"][3]["kernel_ms"] = 0.6, 0.4       # flex-compiled, attention-free
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    page = (tmp_path / "t.md").read_text()
    assert "| s | workbook | 1.00 | 0.90 | 0.50 | 0.12 | 1 |" in page and "the step waits on the host" in page
    assert "- s: 1.50x in step time, 1.50x in kernel time" in page
    assert "0.90" in bench_train.table(doc["rows"], {})
    assert "Host ms is the time to issue one step to an idle GPU (Python" in page     # a row without host_while
    doc["rows"][0]["host_while"] = bench_train.HOST_WHILE                     # what a run writes now
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    page = (tmp_path / "t.md").read_text()
    assert "Host ms is the time to issue one step while the GPU works through a spin queued before it" in page
    assert "idle GPU" not in page and "host ms is above step ms" not in page       # 0.90 ms of host, 1.00 ms steps
    doc["rows"][0]["host_ms"] = 1.1
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    assert "In 1 of 1 rows host ms is above step ms" in (tmp_path / "t.md").read_text()
    doc["rows"][0]["host_ms"] = 0.9
    doc["rows"].append({**doc["rows"][0], "size": "u"})
    doc["rows"][0].pop("host_while")                                          # an older size's row beside it
    path.write_text(json.dumps(doc))
    assert cli(["bench", "report", str(path), "--out", str(tmp_path / "t.md")]) == 0
    page = " ".join((tmp_path / "t.md").read_text().split())
    assert ("so that no launch waits on the GPU in rows of sizes u, else the time to issue one step to an idle GPU"
            in page)


def test_host_time_is_taken_with_the_gpu_busy(monkeypatch):
    """_what_paces queues a spin on the GPU before each step whose host time it takes, so that no
    launch of the step waits on the GPU; the profiled steps follow, with no spin."""
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: order.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("spin", cycles)))
    monkeypatch.setattr(bench_train, "_train_step", lambda model, opt, tokens, targets: order.append("step"))

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []
    monkeypatch.setattr("torch.profiler.profile", Profile)
    host, kernels, attention = bench_train._what_paces(None, None, [(None, None)] * 2)
    spin = ("spin", bench_train.SPIN_CYCLES)
    assert order == ["sync", spin, "step", "sync", spin, "step", "sync", "step", "step", "sync"]
    assert host >= 0 and kernels == attention == 0


@pytest.mark.parametrize("name, attention", [
    ("_flash_forward_kernel", True), ("_bwd_dkdv_kernel_1", True), ("_bwd_preprocess_kernel", True),
    ("_tma_forward_kernel", True), ("_tma_dkdv_kernel", True), ("_tma_dq_kernel", True),
    ("triton_tem_fused_mm_persistent_tma_0", False),
    ("triton_tem_fused__to_copy_flex_attention_backward_mul_sigmoid_0", True),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", True),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", True),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", False),
    ("triton_poi_fused__unsafe_view_cat_mul_silu_silu_backward_split_view_3", False),
    ("triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_4", False),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", False),
])
def test_attention_kernels_are_told_from_the_rest_by_name(name, attention):
    """The names the H100 profile of a step showed: the workbook's kernels, FlexAttention's
    template, SDPA's FlashAttention, cuBLAS's matmuls, Inductor's fused pointwise and reductions."""
    assert bench_train.is_attention_kernel(name) is attention


@pytest.mark.skipif(not runtime.ON_GPU, reason="times training steps on a CUDA GPU")
@pytest.mark.parametrize("provider", ["workbook", "cudnn-compiled", "attention-free"])
def test_a_row_says_what_paces_the_step(provider):
    size = bench_train.Size("t", 2, 256, 64, 2, 4, 2, head_dim=16, vocab=64, window=32)
    r = bench_train.run_one(size, provider, warmup=2, steps=3)
    assert r["host_ms"] > 0 and 0 < r["kernel_ms"]
    if provider == "attention-free":
        assert r["attention_ms"] == 0
    else:
        assert 0 < r["attention_ms"] < r["kernel_ms"]


def test_the_attention_free_step_keeps_the_model_and_drops_attention():
    """The ceiling provider: the same model with o = q, so its step holds everything but attention."""
    size = bench_train.Size("t", 2, 64, 32, 2, 4, 2, head_dim=16, vocab=40, window=8)
    model, step_model = bench_train._model(size, "attention-free", "cpu")
    assert model.attend is bench_train._free_attend and step_model is not model      # compiled, as flex's
    q, k, v = torch.randn(2, 64, 4, 16), torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    assert bench_train._free_attend(q, k, v, model.blocks[0].attn) is q
    tokens, targets = bench_train.batches(size, 1, "cpu")[0]
    model(tokens, targets).backward()                                       # uncompiled: trains
    untouched = {n for n, p in model.named_parameters() if p.grad is None}
    assert untouched == {f"blocks.{i}.attn.{w}" for i in range(2) for w in ("kv.weight", "sinks")}


@pytest.mark.parametrize("steps, count, expected", [
    (20, 4, [range(0, 5), range(5, 10), range(10, 15), range(15, 20)]),
    (7, 3, [range(0, 2), range(2, 4), range(4, 7)]),
    (2, 4, [range(0, 1), range(1, 2)]),
])
def test_rounds_cover_every_timed_step_once_in_order(steps, count, expected):
    assert bench_train.rounds(steps, count) == expected


def test_providers_take_turns_in_each_round():
    """Each provider runs all its timed steps, in order; in every round each one takes a share, with
    the GPU synchronized before every share, so a slow spell of the host falls on all of them."""
    log = []

    class Run:
        def __init__(self, name):
            self.name = name

        def timed(self, indices):
            log.append((self.name, list(indices)))

    bench_train.take_turns([Run("a"), Run("b"), Run("c")], 6, count=2, synchronize=lambda: log.append("sync"))
    assert log == ["sync", ("a", [0, 1, 2]), "sync", ("b", [0, 1, 2]), "sync", ("c", [0, 1, 2]),
                   "sync", ("a", [3, 4, 5]), "sync", ("b", [3, 4, 5]), "sync", ("c", [3, 4, 5])]


def test_the_page_says_how_the_timed_steps_were_taken(tmp_path):
    """A run that took turns says so on its page; a file written before (no "rounds") says nothing,
    and neither does a size where one provider ran alone."""
    rows = [_row("s", p, [2.0, 1.0]) for p in bench_train.SAME_MODEL]
    doc = dict(gpu="GPU X", torch="t", loss_rtol=0.02, loss_gap=bench_train.agreement(rows), rows=rows)
    assert "took turns" not in bench_train.markdown(doc, "f.json")
    doc["rows"] = [{**r, "rounds": 4} for r in rows] + [{**_row("u", p, [2.0]), "rounds": 4} for p in ("a", "b")]
    doc["rows"].append({**_row("v", "flex-compiled", [2.0]), "rounds": 4})
    page = bench_train.markdown(doc, "f.json")
    assert "At s, u the providers took turns: the timed steps ran in 4 rounds" in page and "At s, u, v" not in page


def test_a_size_runs_its_providers_in_turns_end_to_end(monkeypatch):
    """run_size on the CPU, with the GPU's clock, memory counters and profile stood in for: every
    provider trains warm-up plus timed steps on the same batches, and its row has them all."""
    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(order)

        def elapsed_time(self, end):
            return float(end.at - self.at)               # one step between: 1 ms

    order = []
    for name, value in (("synchronize", lambda: order.append("sync")), ("memory_allocated", lambda: 0),
                        ("reset_peak_memory_stats", lambda: None), ("max_memory_allocated", lambda: 2 ** 20),
                        ("Event", Event)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench_train, "_what_paces", lambda model, opt, data: (1.0, 2.0, 0.5))
    real = bench_train._train_step

    def step(model, opt, tokens, targets):
        order.append(model.attend.__name__)
        return real(model, opt, tokens, targets)
    monkeypatch.setattr(bench_train, "_train_step", step)
    monkeypatch.setattr(bench_train, "_model", lambda size, provider, device: (m := bench_train.Decoder(
        size, bench_train._sdpa_attend if provider == "sdpa-floor" else bench_train._free_attend), m))
    size = bench_train.Size("t", 2, 32, 32, 2, 4, 2, head_dim=16, vocab=40, window=8)
    with pytest.warns(UserWarning):                                        # autocast("cuda") off on the CPU
        rows = bench_train.run_size(size, ["sdpa-floor", "attention-free"], warmup=1, steps=2 * bench_train.ROUNDS)
    steps = [x for x in order if x != "sync"]
    turn = ["_sdpa_attend"] * 2 + ["_free_attend"] * 2                       # each provider's share of a round
    assert steps == ["_sdpa_attend", "_free_attend"] + turn * bench_train.ROUNDS
    for r, provider in zip(rows, ["sdpa-floor", "attention-free"]):
        assert r["provider"] == provider and r["rounds"] == bench_train.ROUNDS
        assert len(r["losses"]) == 1 + 2 * bench_train.ROUNDS
        assert r["peak_mib"] == 1 and r["host_ms"] == 1.0 and r["attention_ms"] == 0.5 and r["step_ms"] == 1.0


def test_the_training_probes_check_their_sizes_and_keep_each_row_as_it_comes(tmp_path, capsys):
    """grader/bench/probes/train_tiles.py and step_parts.py share bench train's probe command line:
    an unknown size is named, no GPU is said, and each row reaches the JSON when it is made."""
    from kernels.loader import ROOT, load_file
    for name in ("train_tiles", "step_parts", "step_host_profile"):
        probe = load_file(ROOT / "grader" / "bench" / "probes" / f"{name}.py")
        with pytest.raises(SystemExit) as exit_:
            probe.main(["--sizes", "b8n1024,huge"])
        assert exit_.value.code == 2 and "--sizes: unknown 'huge'; known: b8n1024" in capsys.readouterr().err
        if not runtime.ON_GPU:
            assert probe.main(["--json", str(tmp_path / "x.json")]) == 2
            assert "this probe trains on a CUDA GPU, and none is visible here" in capsys.readouterr().err
    doc, path = {"rows": []}, tmp_path / "probe.json"
    for i in range(2):
        assert bench_train.probe_record(doc, str(path), {"i": i}) == {"i": i}
        assert json.loads(path.read_text())["rows"] == [{"i": j} for j in range(i + 1)]


def test_the_host_profile_probe_groups_the_launchers_by_their_files():
    """step_host_profile.py sums each group's functions by cumulative time a step, matching the file
    as well as the name (another ``run`` or ``__call__`` is not a launcher), and its table shows
    each group; its top list is by a function's own time."""
    from kernels.loader import ROOT, load_file
    probe = load_file(ROOT / "grader" / "bench" / "probes" / "step_host_profile.py")
    site = "/venv/lib/python3.12/site-packages/"
    stats = {(site + "triton/backends/nvidia/driver.py", 700, "__call__"): (16, 16, 0.002, 0.008, {}),
             (site + "triton/tools/tensor_descriptor.py", 34, "from_tensor"): (32, 32, 0.001, 0.004, {}),
             (site + "torch/_inductor/runtime/static_triton_launcher.py", 232, "run"): (113, 113, 0.003, 0.015, {}),
             (site + "torch/_inductor/runtime/triton_heuristics.py", 1407, "run"): (129, 129, 0.008, 0.038, {}),
             (site + "torch/autograd/function.py", 302, "__call__"): (1, 1, 0.0, 0.05, {}),
             ("~", 0, "<built-in method torch.mm>"): (63, 63, 0.015, 0.015, {})}
    assert probe.grouped(stats, 2) == {"Triton launcher": 4.0, "descriptors": 2.0, "Inductor launcher": 7.5}
    assert probe.top(stats, 2, 2) == [["~:<built-in method torch.mm>", 7.5, 31.5],
                                      ["runtime/triton_heuristics.py:run", 4.0, 64.5]]
    row = dict(size="b8n1024", provider="op", host_ms=6.5, profiled_ms=9.75, calls=4276,
               groups=probe.grouped(stats, 2))
    assert probe.summary([row]) == [
        "| size | provider | host ms a step | profiled ms | Python calls a step | Triton launcher ms | "
        "descriptors ms | Inductor launcher ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| b8n1024 | op | 6.50 | 9.75 | 4276 | 4.00 | 2.00 | 7.50 |"]


def test_the_host_profile_probe_puts_the_ops_descriptor_rule_back(monkeypatch):
    """A row of the op with its kernels making their own descriptors sets the op's rule for one
    model only: a model that fails to build leaves the rule as the op finds it (None, unset)."""
    from kernels.loader import ROOT, load_file, load_package
    probe = load_file(ROOT / "grader" / "bench" / "probes" / "step_host_profile.py")
    op = load_package(ROOT / "solutions" / "attention_op")
    seen = []

    def model(size, provider, device):
        seen.append(op.launch._GRAPH_DESCRIPTORS)
        raise RuntimeError("no model here")
    monkeypatch.setattr(bench_train, "_model", model)
    monkeypatch.setattr(op.launch, "_GRAPH_DESCRIPTORS", None)
    with pytest.raises(RuntimeError, match="no model here"):
        probe.run(bench_train.SIZES["b8n1024"], "op-kernel-descriptors", "workbook-compiled", False)
    assert seen == [False] and op.launch._GRAPH_DESCRIPTORS is None


@pytest.fixture
def caches():
    """Inductor's graph cache and AOTAutograd's cache, switched on for a test and put back after
    by assignment (monkeypatch's undo deletes a torch config entry it took for absent)."""
    flags = bench_train.compile_cache_flags()
    assert len(flags) == 2, "this torch names its compile caches otherwise"
    saved = [getattr(config, flag) for config, flag in flags]
    for config, flag in flags:
        setattr(config, flag, True)
    yield flags
    for (config, flag), value in zip(flags, saved):
        setattr(config, flag, value)


def test_the_probes_turn_the_compile_caches_off_in_main_not_at_import(caches):
    """Importing a probe that trains (as the tests do) leaves Inductor's caches as they were; its
    ``compile_caches_off`` turns both off, and what it returns puts them back."""
    from kernels.loader import ROOT, load_file

    for name in ("train_tiles", "compiled_host", "step_parts", "compiled_descriptors", "step_host_profile"):
        load_file(ROOT / "grader" / "bench" / "probes" / f"{name}.py")
        assert all(getattr(config, flag) is True for config, flag in caches), name
    restore = bench_train.compile_caches_off()
    assert all(getattr(config, flag) is False for config, flag in caches)
    restore()
    assert all(getattr(config, flag) is True for config, flag in caches)


def test_bench_train_compiles_afresh(monkeypatch, caches):
    """``bench train`` turns the compile caches off before its first model: a graph cached by an
    earlier run, under an older op, would be timed in place of the op as it is."""
    seen = []

    class Reached(Exception):
        pass

    def first_size(*args, **kwargs):
        seen.append([getattr(config, flag) for config, flag in caches])
        raise Reached
    import torch._dynamo
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", torch._dynamo.config.cache_size_limit)
    monkeypatch.setattr(bench_train.runtime, "ON_GPU", True)
    monkeypatch.setattr(bench_train.runtime, "describe", lambda: "a GPU")
    monkeypatch.setattr(bench_train, "run_size", first_size)
    with pytest.raises(Reached):
        bench_train.main(sizes="b8n1024", providers="workbook-compiled")
    assert seen == [[False, False]]
