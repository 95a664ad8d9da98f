"""Pictures for the notebooks: masks, tile grids, and the online softmax at work.

Every function draws into a matplotlib ``Axes`` (a new figure when none is given) and returns
it, so notebooks can lay several out side by side.  Each notebook's setup cell calls ``use_style()``
once, so every figure shares the same resolution and type sizes.
"""

from __future__ import annotations

import math

from kernels import masks as _masks

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

# Tile states, as the tile grid shows them.
SKIPPED, PARTIAL, FULL = 0, 1, 2
_TILE_COLORS = ListedColormap(["#f0f0f0", "#f4a259", "#5b8e7d"])
_TILE_LABELS = {SKIPPED: "skipped (never loaded)", PARTIAL: "partial (computed, masked)", FULL: "full (computed)"}
_PAST_END = dict(facecolor="white", alpha=0.6, hatch="//", edgecolor="#777777", lw=0)

# Figure defaults for the notebooks.  At 110 dpi a figure is sharp on a laptop screen (72 dpi was
# blurry), and no text is smaller than MIN_FONT_PT.  Notebook figures are at most MAX_WIDTH_IN inches
# wide: at 110 dpi that is 1100 pixels, which a notebook column on a laptop shows without shrinking it,
# so 9 pt stays 9 pt on the screen.
MIN_FONT_PT = 9
MAX_WIDTH_IN = 10
STYLE = {
    "figure.dpi": 110,
    "savefig.dpi": "figure",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "figure.titlesize": 11,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
}


def use_style():
    """Apply ``STYLE`` to every figure made from now on (the notebooks' setup cells call it)."""
    plt.rcParams.update(STYLE)


def _axes(ax, figsize=(4, 4)):
    if ax is None:
        _, ax = plt.subplots(figsize=(min(figsize[0], MAX_WIDTH_IN), figsize[1]))
    return ax


def _block_ticks(ax, rows: int, cols: int, block_m: int, block_n: int):
    """Block numbers at the centre of the tiles: every one up to 16 rows or 10 columns, then every 2nd, ..."""
    step_r, step_c = max(1, math.ceil(rows / 16)), max(1, math.ceil(cols / 10))
    ax.set_xticks([(c + 0.5) * block_n for c in range(0, cols, step_c)], [str(c) for c in range(0, cols, step_c)])
    ax.set_yticks([(r + 0.5) * block_m for r in range(0, rows, step_r)], [str(r) for r in range(0, rows, step_r)])
    ax.set_xlabel(f"key block (block_n = {block_n})")
    ax.set_ylabel(f"query block (block_m = {block_m})")


def _tile_lines(ax, rows: int, cols: int, block_m: int, block_n: int):
    for c in range(cols + 1):
        ax.axvline(c * block_n, color="white", lw=1.5)
    for r in range(rows + 1):
        ax.axhline(r * block_m, color="white", lw=1.5)


def plot_mask(mask, nq: int | None = None, nk: int | None = None, *, ax=None, title: str = "",
              block_m: int | None = None, block_n: int | None = None):
    """Heatmap of a mask (a mask function with ``nq, nk``, or a dense bool tensor).

    With ``block_m``/``block_n`` the tile boundaries are drawn over it.
    """
    dense = mask if isinstance(mask, torch.Tensor) else _masks.materialize(mask, nq, nk)
    dense = dense.detach().cpu().numpy().astype(float)
    nq, nk = dense.shape
    ax = _axes(ax, figsize=(max(3, min(8, nk / 6)), max(3, min(8, nq / 6))))
    ax.imshow(dense, cmap=ListedColormap(["#f0f0f0", "#3d5a80"]), vmin=0, vmax=1,
              interpolation="nearest", aspect="equal")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))      # keys and queries are whole numbers
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    if block_m:
        for y in range(block_m, nq, block_m):
            ax.axhline(y - 0.5, color="#e63946", lw=1)
    if block_n:
        for x in range(block_n, nk, block_n):
            ax.axvline(x - 0.5, color="#e63946", lw=1)
    ax.set_title(title or f"visible (dark): {nq} queries x {nk} keys")
    return ax


def tile_states(mask, nq: int, nk: int, block_m: int, block_n: int) -> np.ndarray:
    """For each (query block, key block) tile: SKIPPED, PARTIAL or FULL, from the mask itself."""
    dense = mask if isinstance(mask, torch.Tensor) else _masks.materialize(mask, nq, nk)
    dense = dense.detach().cpu().numpy()
    rows, cols = math.ceil(nq / block_m), math.ceil(nk / block_n)
    states = np.zeros((rows, cols), dtype=int)
    for r in range(rows):
        for c in range(cols):
            tile = dense[r * block_m:(r + 1) * block_m, c * block_n:(c + 1) * block_n]
            states[r, c] = FULL if tile.all() else PARTIAL if tile.any() else SKIPPED
    return states


def _legend_below(ax, handles):
    """A legend under the axes, clear of the tick labels and the x label."""
    from matplotlib.transforms import offset_copy

    below = offset_copy(ax.transAxes, fig=ax.figure, y=-40, units="points")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
              frameon=False)


def plot_tile_grid(mask, nq: int, nk: int, block_m: int, block_n: int, *, ax=None, title: str = "",
                   annotate: bool = True):
    """Which tiles a kernel computes in full, computes with a mask, or skips entirely.

    When ``nq`` or ``nk`` is not a multiple of its block, the last tiles hang past the sequence
    (hatched: never loaded).  A tile that runs past the last key is partial even where the mask
    keeps every pair, as in the kernels' block schedules: the scores of the missing keys are
    masked.  Rows past the last query need no mask in the scores; they are only never stored.
    """
    states = tile_states(mask, nq, nk, block_m, block_n)
    rows, cols = states.shape
    past_last_key = np.zeros(states.shape, dtype=bool)
    past_last_key[:, -1] = nk % block_n != 0
    states = np.where(past_last_key & (states == FULL), PARTIAL, states)
    # Tiles are drawn in element units, so a 16x64 tile looks four times wider than tall.
    ax = _axes(ax, figsize=(max(3, min(9, cols * block_n / 40 + 1)), max(3, min(9, rows * block_m / 40 + 1))))
    ax.imshow(states, cmap=_TILE_COLORS, vmin=0, vmax=2, interpolation="nearest",
              extent=(0, cols * block_n, rows * block_m, 0), aspect="equal")
    _block_ticks(ax, rows, cols, block_m, block_n)
    _tile_lines(ax, rows, cols, block_m, block_n)
    if annotate and states.size <= 400:
        for (r, c), s in np.ndenumerate(states):
            # Every tile the legend counts gets its letter, on the part of the tile inside the sequence; where
            # that part is a thin strip (a last block of a few rows or keys), on a patch of the tile's colour.
            x0, x1, y0, y1 = c * block_n, min((c + 1) * block_n, nk), r * block_m, min((r + 1) * block_m, nq)
            thin = 4 * (x1 - x0) < block_n or 4 * (y1 - y0) < block_m
            if s:
                ax.text((x0 + x1) / 2, (y0 + y1) / 2, "FPS"[2 - s], ha="center", va="center",
                        fontsize=MIN_FONT_PT, color="white",
                        bbox=dict(facecolor=_TILE_COLORS(s), lw=0, pad=1) if thin else None)
    handles = [Patch(color=_TILE_COLORS(s), label=f"{_TILE_LABELS[s]}: {int((states == s).sum())}")
               for s in (FULL, PARTIAL, SKIPPED)]
    if nq % block_m or nk % block_n:
        mark_sequence_ends(ax, nq, nk)
        handles.append(Patch(**_PAST_END, label="past the last query or key (never loaded)"))
    _legend_below(ax, handles)
    ax.set_title(title or f"{states.size} tiles of {block_m}x{block_n}")
    return ax


def online_softmax_trace(row: torch.Tensor, block: int) -> dict[str, np.ndarray]:
    """Running max ``m`` and running sum ``l`` after each block of one row (float64, NaN-safe)."""
    x = row.detach().double().cpu()
    m, l = -math.inf, 0.0
    ms, ls, ends = [], [], []
    for start in range(0, x.numel(), block):
        xb = x[start:start + block]
        m_new = max(m, float(xb.max()))
        shift = 0.0 if m_new == -math.inf else m_new
        l = l * math.exp(m - shift) + float(torch.exp(xb - shift).sum())
        m = m_new
        ms.append(m)
        ls.append(l)
        ends.append(min(start + block, x.numel()))
    return {"end": np.array(ends), "m": np.array(ms), "l": np.array(ls)}


def plot_online_softmax(row: torch.Tensor, block: int, *, axes=None):
    """Three panels: the row with its blocks, the running max, and the running sum rescaled."""
    trace = online_softmax_trace(row, block)
    x = row.detach().double().cpu().numpy()
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(MAX_WIDTH_IN, 3.4))
    a0, a1, a2 = axes
    a0.plot(np.arange(x.size), x, ".", ms=3, color="#3d5a80")
    for end in trace["end"][:-1]:
        a0.axvline(end - 0.5, color="#e63946", lw=1)
    a0.set_title(f"the row, in blocks of {block}")
    a0.set_xlabel("column")
    a1.step(trace["end"], trace["m"], where="post", color="#e63946")
    a1.plot(trace["end"], trace["m"], "o", color="#e63946")
    a1.axhline(x.max(), ls="--", color="gray", lw=1, label="true max")
    a1.set_title("running max m")
    a1.set_xlabel("columns read")
    a1.legend(loc="center left")
    exact = np.exp(x - x.max()).sum()
    a2.plot(trace["end"], trace["l"], "o-", color="#5b8e7d", label="l, relative to the running m")
    a2.axhline(exact, ls="--", color="gray", lw=1, label="sum exp(x - max)")
    a2.set_ylim(0, 1.45 * max(trace["l"].max(), exact))       # headroom: the legend sits above the curve
    a2.set_title("running sum l (rescaled\nwhen m grows)")
    a2.set_xlabel("columns read")
    a2.legend(loc="upper left")
    plt.tight_layout()
    return axes


def mark_sequence_ends(ax, nq: int, nk: int):
    """Hatch the part of a tile grid that lies past the last query or the last key.

    ``plot_tile_grid`` calls it itself when ``nq`` or ``nk`` is not a multiple of the block: the
    last tiles are then partial, and the hatched part is never loaded.
    """
    from matplotlib.patches import Rectangle

    x0, x1 = sorted(ax.get_xlim())
    y0, y1 = sorted(ax.get_ylim())
    label = dict(ha="center", va="center", fontsize=MIN_FONT_PT, color="#333333",
                 bbox=dict(facecolor="white", alpha=0.8, lw=0, pad=1))
    # A strip under a tenth of the grid is too thin for its label; the legend names it.
    if nk < x1:
        ax.add_patch(Rectangle((nk, y0), x1 - nk, y1 - y0, **_PAST_END))
        ax.axvline(nk, color="#e63946", lw=1.5, ls="--")
        if x1 - nk >= (x1 - x0) / 10:
            ax.text((nk + x1) / 2, (y0 + min(nq, y1)) / 2, f"past the last key ({nk - 1})", rotation=90, **label)
    if nq < y1:
        ax.add_patch(Rectangle((x0, nq), min(nk, x1) - x0, y1 - nq, **_PAST_END))
        ax.axhline(nq, color="#e63946", lw=1.5, ls="--")
        if y1 - nq >= (y1 - y0) / 10:
            ax.text((x0 + min(nk, x1)) / 2, (nq + y1) / 2, f"past the last query ({nq - 1})", **label)
    return ax


def plot_program_ownership(m: int, n: int, block_m: int, block_n: int, *, ax=None, title: str = ""):
    """Which program owns each element of an (m, n) tensor, and in which loop iteration it is read.

    The grid is one program per ``block_m`` rows; each program walks its rows ``block_n`` columns
    at a time.  Colour: the program; number: the loop iteration (column block); hatched: lanes of
    the last blocks that hang past the tensor and are masked off.
    """
    rows, cols = math.ceil(m / block_m) * block_m, math.ceil(n / block_n) * block_n
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    program = r // block_m
    real = (r < m) & (c < n)
    palette = plt.get_cmap("tab10")
    image = np.ones((rows, cols, 3))
    for p in range(rows // block_m):
        image[(program == p) & real] = palette(p % 10)[:3]
    shade = ((c // block_n) % 2 == 1) & real                  # alternate column blocks lighter
    image[shade] = 0.65 * image[shade] + 0.35
    image[~real] = 0.93
    ax = _axes(ax, figsize=(max(3.5, min(10, cols / 2.2)), max(2.5, min(8, rows / 2.2))))
    ax.imshow(image, interpolation="nearest", aspect="equal")
    from matplotlib.patches import Rectangle
    for (i, j), ok in np.ndenumerate(real):
        if not ok:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#aaaaaa", lw=0))
        elif rows * cols <= 600:
            ax.text(j, i, str(j // block_n), ha="center", va="center", fontsize=MIN_FONT_PT, color="white")
    for x in range(block_n, cols, block_n):
        ax.axvline(x - 0.5, color="black", lw=1.2)
    for y in range(block_m, rows, block_m):
        ax.axhline(y - 0.5, color="black", lw=1.2)
    ax.axvline(n - 0.5, color="#e63946", lw=1.5, ls="--")
    if m < rows:
        ax.axhline(m - 0.5, color="#e63946", lw=1.5, ls="--")
    ax.set_yticks(range(rows), [str(i) if i < m else f"({i})" for i in range(rows)])
    ax.set_xticks(range(0, cols, max(1, block_n // 4)))
    ax.set_xlabel("column  (number: the loop iteration that reads it;\nhatched: masked lanes, past the dashed lines)")
    ax.set_ylabel("row")
    ax.set_title(title or f"({m}, {n}): {rows // block_m} programs of {block_m} rows, "
                          f"{cols // block_n} column blocks of {block_n}")
    return ax


def plot_memory_order(x: torch.Tensor, *, ax=None, title: str = ""):
    """The memory behind a 2-D tensor or view, one cell per element slot, in address order.

    Each slot shows which element ``(r, c)`` of ``x`` lives there and is coloured by its row,
    so a contiguous tensor shows rows as runs and a transposed view shows them interleaved.
    Slots of the storage that ``x`` does not use (the gaps of a strided slice) are grey.
    """
    if x.ndim != 2:
        raise ValueError(f"x must have 2 dimensions, got shape {tuple(x.shape)}")
    m, n = x.shape
    s0, s1 = x.stride()
    span = (m - 1) * s0 + (n - 1) * s1 + 1 if x.numel() else 0
    owner = np.full(span, -1)
    label = [""] * span
    for r in range(m):
        for c in range(n):
            owner[r * s0 + c * s1] = r
            label[r * s0 + c * s1] = f"{r},{c}"
    palette = plt.get_cmap("tab10")
    image = np.array([palette(o % 10)[:3] if o >= 0 else (0.93, 0.93, 0.93) for o in owner])[None]
    ax = _axes(ax, figsize=(max(4, min(13, span * 0.45)), 1.3))
    ax.imshow(image, interpolation="nearest", aspect="auto")
    for a, text in enumerate(label):
        ax.text(a, 0, text, ha="center", va="center", fontsize=MIN_FONT_PT, rotation=90 if span > 30 else 0,
                color="white" if text else "#999999")
    ax.set_yticks([])
    ax.set_xticks(range(0, span, max(1, span // 16)))
    ax.set_xlabel("address offset from x.data_ptr(), in elements  (label: r,c)")
    ax.set_title(title or f"shape {tuple(x.shape)}, strides {tuple(x.stride())}: "
                          f"x[r, c] at offset r*{s0} + c*{s1}", fontsize=10)
    return ax


def plot_padding_waste(head_dims, waste, *, highlight=(), ax=None, title: str = ""):
    """Bar chart of the fraction of matrix work spent on padding, one bar per head dim.

    ``waste[i]`` belongs to ``head_dims[i]`` (for example ``padding_waste(d)`` of stage 3).
    Head dims in ``highlight`` are drawn in a second colour and labelled with their value.
    """
    head_dims = [int(d) for d in head_dims]
    waste = [float(w) for w in waste]
    ax = _axes(ax, figsize=(MAX_WIDTH_IN, 3.2))
    marked = set(int(d) for d in highlight)
    colors = ["#e63946" if d in marked else "#8da9c4" for d in head_dims]
    ax.bar(head_dims, waste, width=1.0, color=colors, edgecolor="none")
    for d, w in zip(head_dims, waste):
        if d in marked:
            ax.annotate(f"D={d}: {w:.1%}", (d, w), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", rotation=90, fontsize=MIN_FONT_PT, color="#e63946")
    for p in (16, 32, 64, 128, 256):
        if head_dims and min(head_dims) <= p <= max(head_dims):
            ax.axvline(p, color="#5b8e7d", lw=0.8, ls=":")
    ax.set_xlabel("head dim D (dotted: powers of two, no waste)")
    ax.set_ylabel("fraction of work on padding")
    ax.set_ylim(0, max(waste + [0.0]) * 1.35 + 0.02)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:.0%}"))
    ax.set_title(title or "padding a head dim up to the next power of two")
    return ax


def plot_visits(visits, mask, nq: int, nk: int, block_m: int, block_n: int, *, ax=None, title: str = ""):
    """Which tiles a kernel actually processed (``visits``: counts per (query block, key block)),
    coloured by what the mask says is in them.

    Processed tiles are green when every pair in them is visible, orange when the mask cuts
    them, red when they hold no visible pair (wasted work); tiles left alone are light grey,
    or black when they hold visible pairs (a bug: those gradients are missing).  A number
    over 1 in a tile means it was processed that many times.
    """
    visits = np.asarray(visits.detach().cpu() if isinstance(visits, torch.Tensor) else visits)
    states = tile_states(mask, nq, nk, block_m, block_n)
    rows, cols = states.shape
    kinds = np.where(visits > 0, np.where(states == FULL, 2, np.where(states == PARTIAL, 1, 3)),
                     np.where(states == SKIPPED, 0, 4))
    colors = ["#f0f0f0", "#f4a259", "#5b8e7d", "#e63946", "#222222"]
    labels = ["skipped", "processed, masked", "processed, whole", "processed, nothing visible (waste)",
              "skipped, but holds visible pairs (bug)"]
    ax = _axes(ax, figsize=(max(3, min(9, cols * block_n / 40 + 1)), max(3, min(9, rows * block_m / 40 + 1))))
    ax.imshow(kinds, cmap=ListedColormap(colors), vmin=0, vmax=4, interpolation="nearest",
              extent=(0, cols * block_n, rows * block_m, 0), aspect="equal")
    _tile_lines(ax, rows, cols, block_m, block_n)
    for (r, c), n in np.ndenumerate(visits):
        if n > 1:
            ax.text((c + 0.5) * block_n, (r + 0.5) * block_m, str(int(n)), ha="center", va="center",
                    fontsize=MIN_FONT_PT, color="white")
    _block_ticks(ax, rows, cols, block_m, block_n)
    present = [i for i in range(5) if (kinds == i).any() or i in (0, 1, 2)]
    _legend_below(ax, [Patch(color=colors[i], label=f"{labels[i]}: {int((kinds == i).sum())}") for i in present])
    ax.set_title(title or f"{int((visits > 0).sum())} of {visits.size} tiles of {block_m}x{block_n} processed")
    return ax


def plot_head_groups(hq: int, hkv: int, *, ax=None, title: str = "", kv_head=None):
    """Which key/value head each query head reads: query heads on top, K/V heads below.

    ``kv_head(h)`` gives the K/V head of query head ``h``; the default is the workbook's
    ``h // (hq // hkv)``.  Each K/V head sits under the group of query heads that the default
    assigns to it, so another mapping (``h % hkv``, a common bug) shows as crossing lines.
    """
    if hkv < 1 or hq % hkv:
        raise ValueError(f"hq must be a multiple of hkv, got hq={hq}, hkv={hkv}")
    group = hq // hkv
    kv_head = kv_head or (lambda h: h // group)
    palette = plt.get_cmap("tab10")
    ax = _axes(ax, figsize=(max(4, hq * 0.55), 2.4))
    kv_x = [(j + 0.5) * group - 0.5 for j in range(hkv)]
    for h in range(hq):
        j = int(kv_head(h))
        ax.plot([h, kv_x[j]], [1, 0], color=palette(j % 10), lw=1.5, alpha=0.8, zorder=1)
        ax.add_patch(plt.Rectangle((h - 0.35, 0.9), 0.7, 0.2, color=palette(j % 10), zorder=2))
        ax.text(h, 1.0, f"q{h}", ha="center", va="center", fontsize=MIN_FONT_PT, color="white", zorder=3)
    for j, x in enumerate(kv_x):
        width = max(0.7, min(group - 0.3, 2.5))
        ax.add_patch(plt.Rectangle((x - width / 2, -0.12), width, 0.24, color=palette(j % 10), zorder=2))
        ax.text(x, 0.0, f"kv{j}", ha="center", va="center", fontsize=MIN_FONT_PT, color="white", zorder=3)
    ax.set_xlim(-0.8, hq - 0.2)
    ax.set_ylim(-0.35, 1.3)
    ax.set_yticks([0, 1], ["K/V heads", "query heads"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"Hq = {hq}, Hkv = {hkv}: groups of {group}", fontsize=10)
    return ax
