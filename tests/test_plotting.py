"""The notebooks' figures: sharp and readable on a laptop, with legends that say what is drawn.

``plotting.use_style()`` holds the figure defaults every notebook's setup cell applies; each helper
is drawn here under it and every piece of text it writes is measured.
"""

from __future__ import annotations

import json

from kernels import masks, plotting
from kernels.loader import ROOT

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.text import Text

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(autouse=True)
def style():
    with plt.rc_context():
        plotting.use_style()
        yield
    plt.close("all")


def test_the_defaults_are_sharp_and_no_text_is_under_9_pt():
    assert plotting.STYLE["figure.dpi"] >= 110
    assert plotting.MIN_FONT_PT >= 9
    sizes = {k: v for k, v in plotting.STYLE.items() if "size" in k}
    assert sizes and all(v >= plotting.MIN_FONT_PT for v in sizes.values()), sizes
    assert plt.rcParams["figure.dpi"] == plotting.STYLE["figure.dpi"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_takes_the_defaults_from_plotting(path):
    setup = "".join(json.loads(path.read_text())["cells"][2]["source"])
    assert "plotting.use_style()" in setup
    assert "figure.dpi" not in setup


def _helper_figures():
    row = 2.0 * torch.randn(512, generator=torch.Generator().manual_seed(0))
    yield "online softmax", plotting.plot_online_softmax(row, 64)[0].figure
    yield "tile grid", plotting.plot_tile_grid(masks.causal(100, 150), 100, 150, 32, 64).figure
    yield "tile grid, 32 blocks", plotting.plot_tile_grid(masks.causal(512, 512), 512, 512, 16, 64).figure
    yield "visits", plotting.plot_visits(torch.ones(4, 3), masks.causal(128, 96), 128, 96, 32, 32).figure
    yield "mask", plotting.plot_mask(masks.causal(12, 6), 12, 6, block_m=4, block_n=4).figure
    yield "program ownership", plotting.plot_program_ownership(5, 10, 2, 4).figure
    yield "memory order", plotting.plot_memory_order(torch.arange(48.0).reshape(4, 12)[:, ::2].t()).figure
    yield "padding waste", plotting.plot_padding_waste(range(16, 257), [0.1] * 241, highlight=(72,)).figure
    yield "head groups", plotting.plot_head_groups(8, 2).figure


def test_every_helper_writes_readable_text_in_a_figure_a_laptop_shows_unshrunk():
    for name, fig in _helper_figures():
        fig.canvas.draw()
        small = {t.get_text(): t.get_fontsize() for t in fig.findobj(Text)
                 if t.get_visible() and t.get_text().strip() and t.get_fontsize() < plotting.MIN_FONT_PT}
        assert not small, f"{name}: text under {plotting.MIN_FONT_PT} pt: {small}"
        assert fig.get_figwidth() <= plotting.MAX_WIDTH_IN, name


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_tile_grid_legend_counts_what_is_drawn_including_the_ends_past_the_sequence():
    # 100 queries and 150 keys in 32x64 tiles, no mask: the last row and column of tiles hang past
    # the sequence (hatched). The last key block's tiles mask the missing keys' scores, as the
    # kernels' block schedules do; rows past the last query are only never stored.
    ax = plotting.plot_tile_grid(masks.full(), 100, 150, 32, 64)
    assert _legend(ax) == ["full (computed): 8", "partial (computed, masked): 4", "skipped (never loaded): 0",
                           "past the last query or key (never loaded)"]
    assert {t.get_text() for t in ax.texts} >= {"past the last key (149)", "past the last query (99)"}
    letters = [t.get_text() for t in ax.texts]
    assert (letters.count("F"), letters.count("P")) == (8, 4)      # every tile counted is labelled, thin ones too
    # Lengths that are multiples of the blocks: nothing is hatched and the legend says nothing of it.
    ax = plotting.plot_tile_grid(masks.causal(128, 128), 128, 128, 32, 64)
    assert _legend(ax) == ["full (computed): 2", "partial (computed, masked): 4", "skipped (never loaded): 2"]
    assert not ax.patches
