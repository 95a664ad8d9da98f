"""kernels/tuning.py: which tile a call gets, with and without the autotuner."""

from __future__ import annotations

import os

from kernels import runtime, tuning
from kernels.loader import load_stage

import pytest

TABLES = {"forward": tuning.FORWARD_TILES}


def _stage9_tables():
    stage9 = load_stage("stage9", "solutions")
    return {"dkdv": stage9.DKDV_TILES, "dq": stage9.DQ_TILES}


class _FakeAutotuned:
    """Stands in for a triton.autotune object: ``fn`` is the kernel without the tuner."""
    fn = object()


def test_row_for_each_head_dim():
    tiles = tuning.FORWARD_TILES
    assert tuning._entries(tiles, 16) is tiles[64]       # the smallest listed head dim that holds it
    assert tuning._entries(tiles, 64) is tiles[64]
    assert tuning._entries(tiles, 128) is tiles[128]
    assert tuning._entries(tiles, 256) is tiles[256]


@pytest.mark.parametrize("name", ["forward", "dkdv", "dq"])
def test_tables_are_well_formed(name):
    tiles = TABLES[name] if name in TABLES else _stage9_tables()[name]
    assert max(tiles) >= 256, "every head dim up to 256 needs a row"
    for head_dim, rows in tiles.items():
        assert rows, f"{name}: empty row for head dim {head_dim}"
        assert len(set(rows)) == len(rows), f"{name}: a tile listed twice for head dim {head_dim}"
        for bm, bn, warps, stages in rows:
            for size in (bm, bn):
                assert size >= 16 and size & (size - 1) == 0, f"{name}: block size {size} is not a power of two >= 16"
            assert warps in (2, 4, 8) and 1 <= stages <= 5


def test_autotune_prunes_to_the_call_head_dim():
    kernel = load_stage("stage5", "solutions")._flash_forward_kernel      # a real tuning.autotune kernel
    assert len(kernel.configs) == sum(len(rows) for rows in tuning.FORWARD_TILES.values())
    for head_dim in (32, 64, 128, 256):
        configs = kernel.early_config_prune(kernel.configs, {}, HEAD_DIM_PAD=head_dim)
        got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]
        assert got == tuning._entries(tuning.FORWARD_TILES, head_dim)


def test_plan_on_the_interpreter_uses_the_interpreter_tile(monkeypatch):
    monkeypatch.setattr(runtime, "ON_GPU", False)
    kernel, tile = tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 64, 8192, 8192, interpreter_tile=(32, 16, 4, 1))
    assert kernel is _FakeAutotuned.fn
    assert tile == {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def test_plan_on_a_gpu(monkeypatch):
    monkeypatch.setattr(runtime, "ON_GPU", True)
    long, short = tuning.TUNE_FROM, tuning.TUNE_FROM // 2
    # long sequences: the autotuner, which picks the tile itself
    assert tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, long, 1, interpreter_tile=(32, 32, 4, 1)) == (
        _FakeAutotuned, {})
    first = tuning.FORWARD_TILES[128][0]
    fixed = {"BLOCK_M": first[0], "BLOCK_N": first[1], "num_warps": first[2], "num_stages": first[3]}
    # short sequences, or counted visits: the first entry, untimed
    assert tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, short, 1, interpreter_tile=(32, 32, 4, 1)) == (
        _FakeAutotuned.fn, fixed)
    assert tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, long, 1, interpreter_tile=(32, 32, 4, 1),
                       counting=True) == (_FakeAutotuned.fn, fixed)
    # a tile asked for wins over the table, and switches the autotuner off
    kernel, tile = tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, long, 1, interpreter_tile=(32, 32, 4, 1),
                               block_n=32)
    assert kernel is _FakeAutotuned.fn and tile["BLOCK_N"] == 32 and tile["BLOCK_M"] == first[0]


def test_the_graders_workers_never_autotune(monkeypatch):
    """A check needs the right answer, not the fastest tile: grading workers take the first entry."""
    from grader.isolation import sandbox
    assert list(sandbox.NO_AUTOTUNE) == [tuning.AUTOTUNE_ENV]
    for home in (None, "/tmp/learner"):
        assert sandbox.worker_env(home=home, uid=None)[tuning.AUTOTUNE_ENV] == "0"
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    kernel, tile = tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, tuning.TUNE_FROM, 1,
                               interpreter_tile=(32, 32, 4, 1))
    assert kernel is _FakeAutotuned.fn and (tile["BLOCK_M"], tile["BLOCK_N"]) == tuning.FORWARD_TILES[128][0][:2]


def test_untuned_takes_the_first_entry_and_restores_the_setting(monkeypatch):
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    args = (_FakeAutotuned, tuning.FORWARD_TILES, 128, tuning.TUNE_FROM, 1)
    with tuning.untuned():
        kernel, tile = tuning.plan(*args, interpreter_tile=(32, 32, 4, 1))
    assert kernel is _FakeAutotuned.fn and (tile["BLOCK_M"], tile["BLOCK_N"]) == tuning.FORWARD_TILES[128][0][:2]
    assert tuning.plan(*args, interpreter_tile=(32, 32, 4, 1)) == (_FakeAutotuned, {})
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    with pytest.raises(KeyError), tuning.untuned():
        raise KeyError("an error inside")
    assert tuning.AUTOTUNE_ENV not in os.environ


def test_gqa_pack_takes_whole_groups_of_two_four_or_eight_heads():
    assert [tuning.gqa_pack(g) for g in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 1, 4, 1, 8, 1]


def test_what_no_tile_fits_is_refused_with_the_reason(monkeypatch):
    """A T4 (64 KB per block) cannot hold stage 9's dK/dV tiles in float32 at head dim 256: the backward
    says so before launching, and points at float16, instead of Triton's "out of resource"."""
    import pytest
    import torch
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(tuning, "smem_per_block", lambda: 64 * 1024)
    with pytest.raises(ValueError, match=r"float32 at head dim 256.*64 KB.*float16"):
        tuning.check_fits(torch.float32, 256, kernels="stage 9's dK/dV kernel")
    tuning.check_fits(torch.float16, 256, kernels="stage 9's dK/dV kernel")
    tuning.check_fits(torch.float32, 128, kernels="stage 9's dK/dV kernel")
    monkeypatch.setattr(tuning, "smem_per_block", lambda: 99 * 1024)
    tuning.check_fits(torch.float32, 256, kernels="stage 9's dK/dV kernel")


def test_tuned_from_times_shorter_calls_within_and_restores_the_threshold(monkeypatch):
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    committed, short = tuning.TUNE_FROM, 1024 * 1024
    args = (_FakeAutotuned, tuning.FORWARD_TILES, 128, short, 1)
    assert tuning.plan(*args, interpreter_tile=(32, 32, 4, 1))[0] is _FakeAutotuned.fn
    with tuning.tuned_from(short):
        assert tuning.plan(*args, interpreter_tile=(32, 32, 4, 1)) == (_FakeAutotuned, {})
        assert tuning.plan(_FakeAutotuned, tuning.FORWARD_TILES, 128, short // 2, 1,
                           interpreter_tile=(32, 32, 4, 1))[0] is _FakeAutotuned.fn
    assert tuning.TUNE_FROM == committed
    with pytest.raises(KeyError), tuning.tuned_from(1):
        raise KeyError("an error inside")
    assert tuning.TUNE_FROM == committed
    with tuning.tuned_from(2 * committed):                  # never raises the threshold
        assert tuning.TUNE_FROM == committed
