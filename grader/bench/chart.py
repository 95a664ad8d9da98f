"""A bar chart of the rows: TFLOP/s per case and provider, one panel per stage."""

from __future__ import annotations

from grader.bench.tables import cell

_COLORS = {"solution": "#d62728", "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#17becf", "flex": "#2ca02c",
           "stage3-triton": "#ff7f0e", "solution-tma": "#9467bd",
           "solution-wgmma": "#8c564b", "op": "#e377c2"}


def plot(rows: list[dict], path, *, title: str | None = None) -> None:
    """A PNG of TFLOP/s per case (grouped horizontal bars, one per provider), one panel per stage."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    if not stages:
        raise ValueError("no rows to plot")
    layout = []
    for stage in stages:
        mine = [r for r in rows if r["stage"] == stage]
        layout.append((stage, list(dict.fromkeys(r["case"] for r in mine)),
                       list(dict.fromkeys(r["provider"] for r in mine)), {(r["case"], r["provider"]): r for r in mine}))
    heights = [0.19 * len(cases) * len(names) + 0.25 * len(cases) + 0.9 for _, cases, names, _ in layout]
    height = sum(heights) + (0.4 if title else 0)
    # Constrained layout makes room for the title above the first panel and the legends beside them.
    fig = Figure(figsize=(12, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(layout), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    for ax, (stage, cases, names, get) in zip(axes, layout):
        bar = 0.8 / len(names)
        top = max([r["tflops"] for r in get.values() if r["tflops"]] or [1.0])
        for j, name in enumerate(names):
            for i, case in enumerate(cases):
                row = get.get((case, name))
                y = i - 0.4 + (j + 0.5) * bar
                value = row["tflops"] if row and row["tflops"] else 0.0
                ax.barh(y, value, height=bar * 0.9, color=_COLORS.get(name, f"C{j}"),
                        label=name if i == 0 else None)
                text = f" {value:.0f}" if value else f" {cell(row)}"
                ax.text(value, y, text, va="center", fontsize=9, color="black" if value else "gray")
        ax.set_yticks(range(len(cases)), cases, fontsize=9)
        ax.set_ylim(len(cases) - 0.5, -0.5)
        ax.set_xlim(0, top * 1.12)
        ax.set_title(stage, fontsize=11, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    axes[-1].set_xlabel("useful TFLOP/s (higher is better)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path)
