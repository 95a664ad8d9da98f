"""Pictures for the notebooks: masks, tile grids, and the online softmax at work.

Every function draws into a matplotlib ``Axes`` (a new figure when none is given) and returns
it, so notebooks can lay several out side by side.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from kernels import masks as _masks

# Tile states, as the tile grid shows them.
SKIPPED, PARTIAL, FULL = 0, 1, 2
_TILE_COLORS = ListedColormap(["#f0f0f0", "#f4a259", "#5b8e7d"])
_TILE_LABELS = {SKIPPED: "skipped (never loaded)", PARTIAL: "partial (computed, masked)", FULL: "full (computed)"}


def _axes(ax, figsize=(4, 4)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


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


def plot_tile_grid(mask, nq: int, nk: int, block_m: int, block_n: int, *, ax=None, title: str = "",
                   annotate: bool = True):
    """Which tiles a kernel computes in full, computes with a mask, or skips entirely."""
    states = tile_states(mask, nq, nk, block_m, block_n)
    rows, cols = states.shape
    # Tiles are drawn in element units, so a 16x64 tile looks four times wider than tall.
    ax = _axes(ax, figsize=(max(3, min(9, cols * block_n / 40 + 1)), max(3, min(9, rows * block_m / 40 + 1))))
    ax.imshow(states, cmap=_TILE_COLORS, vmin=0, vmax=2, interpolation="nearest",
              extent=(0, cols * block_n, rows * block_m, 0), aspect="equal")
    ax.set_xticks([(c + 0.5) * block_n for c in range(cols)], [str(c) for c in range(cols)])
    ax.set_yticks([(r + 0.5) * block_m for r in range(rows)], [str(r) for r in range(rows)])
    ax.set_xlabel(f"key block (block_n = {block_n})")
    ax.set_ylabel(f"query block (block_m = {block_m})")
    for c in range(cols + 1):
        ax.axvline(c * block_n, color="white", lw=1.5)
    for r in range(rows + 1):
        ax.axhline(r * block_m, color="white", lw=1.5)
    if annotate and states.size <= 400:
        for (r, c), s in np.ndenumerate(states):
            ax.text((c + 0.5) * block_n, (r + 0.5) * block_m, "FPS"[2 - s] if s else "",
                    ha="center", va="center", fontsize=8, color="white")
    counts = {s: int((states == s).sum()) for s in (FULL, PARTIAL, SKIPPED)}
    ax.legend(handles=[Patch(color=_TILE_COLORS(s), label=f"{_TILE_LABELS[s]}: {counts[s]}")
                       for s in (FULL, PARTIAL, SKIPPED)],
              loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8, frameon=False)
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
        _, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    a0, a1, a2 = axes
    a0.plot(np.arange(x.size), x, ".", ms=3, color="#3d5a80")
    for end in trace["end"][:-1]:
        a0.axvline(end - 0.5, color="#e63946", lw=1)
    a0.set_title(f"the row, read in blocks of {block}")
    a0.set_xlabel("column")
    a1.step(trace["end"], trace["m"], where="post", color="#e63946")
    a1.plot(trace["end"], trace["m"], "o", color="#e63946")
    a1.axhline(x.max(), ls="--", color="gray", lw=1, label="true max")
    a1.set_title("running max m after each block")
    a1.set_xlabel("columns read")
    a1.legend(fontsize=8)
    exact = np.exp(x - x.max()).sum()
    a2.plot(trace["end"], trace["l"], "o-", color="#5b8e7d", label="running l (relative to running m)")
    a2.axhline(exact, ls="--", color="gray", lw=1, label="sum exp(x - max)")
    a2.set_title("running sum l, rescaled when m grows")
    a2.set_xlabel("columns read")
    a2.legend(fontsize=8)
    plt.tight_layout()
    return axes


def mark_sequence_ends(ax, nq: int, nk: int):
    """Hatch the part of a tile grid that lies past the last query or the last key.

    Use it on the axes ``plot_tile_grid`` returns when ``nq`` or ``nk`` is not a multiple of
    the block: the last tiles are then partial, and the hatched part is never loaded.
    """
    from matplotlib.patches import Rectangle

    x0, x1 = sorted(ax.get_xlim())
    y0, y1 = sorted(ax.get_ylim())
    style = dict(facecolor="white", alpha=0.6, hatch="//", edgecolor="#777777", lw=0)
    if nk < x1:
        ax.add_patch(Rectangle((nk, y0), x1 - nk, y1 - y0, **style))
        ax.axvline(nk, color="#e63946", lw=1.5, ls="--")
        ax.text((nk + x1) / 2, (y0 + y1) / 2, f"past key {nk - 1}", rotation=90, ha="center",
                va="center", fontsize=8, color="#333333")
    if nq < y1:
        ax.add_patch(Rectangle((x0, nq), min(nk, x1) - x0, y1 - nq, **style))
        ax.axhline(nq, color="#e63946", lw=1.5, ls="--")
        ax.text((x0 + min(nk, x1)) / 2, (nq + y1) / 2, f"past query {nq - 1}", ha="center",
                va="center", fontsize=8, color="#333333")
    return ax
