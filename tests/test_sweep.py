"""A short sweep in CI: the reference passes every check with room to spare on a few seeds.

``python -m grader sweep`` runs the long version (hundreds of seeds); docs/verdicts.md has its margins.
"""

from grader import stages
from grader.testing.sweep import sweep

MARGIN = 0.8     # the reference's error stays below 80 % of what a check allows


def _assert_margins(found):
    for m in found.values():
        assert not m.failures, f"the reference fails {m.check} on seeds {m.failures}"
        assert m.worst < MARGIN, (f"{m.check}: the reference uses {m.worst:.2f} of its tolerance on seed "
                                  f"{m.worst_seed} ({m.worst_what}); the rule leaves too little room")


def test_stage1_reference_has_margin_on_a_few_seeds():
    _assert_margins(sweep(stages.find("stage1"), range(3)))


def test_stage3_padded_head_dims_pass_the_seed_that_once_failed():
    # float32, D=200 padded to 256: PyTorch's own max error happened to be small on this seed
    found = sweep(stages.find("stage3"), [1835936174, 0, 1], only=["head_dims_padded"])
    _assert_margins(found)
    assert found["head_dims_padded"].runs == 3 and found["head_dims_padded"].worst > 0


def test_a_parallel_sweep_finds_what_a_serial_one_does():
    from grader.testing.sweep import sweep_parallel
    stage = stages.find("stage1")
    serial = sweep(stage, range(2), only=["attention_lse_and_scale", "softmax_float16"])
    parallel = sweep_parallel(stage, range(2), jobs=2, only=["attention_lse_and_scale", "softmax_float16"])
    assert list(parallel) == list(serial)
    for name, m in serial.items():
        assert (parallel[name].runs, parallel[name].worst, parallel[name].worst_seed) == (m.runs, m.worst, m.worst_seed)
