"""The rows as a table of TFLOP/s and ratios, and as JSON with the machine they were measured on."""

from __future__ import annotations

import json

JSON_KEYS = ("stage", "case", "provider", "ms", "tflops", "peak_mib", "input_mib", "note")


def format_row(row: dict) -> str:
    head = f"  {row['case']:<42} {row['provider']:<14}"
    if row["ms"] is None:
        return f"{head} {row['note']}"
    peak = f" {row['peak_mib']:8.0f} MiB peak" if row.get("peak_mib") is not None else ""
    return f"{head} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s{peak}"


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["tflops"] is not None:
        return f"{row['tflops']:.1f}"
    return row["note"].split(":")[0] or "-"           # n/a, wrong, failed


def table(rows: list[dict]) -> str:
    """TFLOP/s of each provider per case and the solution's speed relative to each other provider
    (solution TFLOP/s / theirs: above 1 the solution is faster); one block per stage, then notes."""
    lines = ["useful TFLOP/s (FlashAttention's FLOP count of the visible pairs; median of do_bench);",
             "'vs X': the solution's TFLOP/s over X's (above 1.00x the solution is faster)"]
    for stage in dict.fromkeys(r["stage"] for r in rows):
        mine = [r for r in rows if r["stage"] == stage]
        names = list(dict.fromkeys(r["provider"] for r in mine))
        cases = list(dict.fromkeys(r["case"] for r in mine))
        get = {(r["case"], r["provider"]): r for r in mine}
        others = [n for n in names if n != "solution"] if "solution" in names else []
        width = max(len(c) for c in cases) + 2
        cols = [max(len(n), 6) + 2 for n in names]
        ratio_cols = [len(f"vs {n}") + 2 for n in others]
        lines += ["", f"{stage}:", f"{'case':<{width}}" + "".join(f"{n:>{w}}" for n, w in zip(names, cols))
                  + "".join(f"{'vs ' + n:>{w}}" for n, w in zip(others, ratio_cols))]
        for c in cases:
            line = f"{c:<{width}}" + "".join(f"{cell(get.get((c, n))):>{w}}" for n, w in zip(names, cols))
            sol = get.get((c, "solution"))
            for n, w in zip(others, ratio_cols):
                r = get.get((c, n))
                ok = sol and sol["tflops"] and r and r["tflops"]
                line += f"{sol['tflops'] / r['tflops']:>{w - 1}.2f}x" if ok else f"{'-':>{w}}"
            lines.append(line)
        if any(r.get("peak_mib") is not None for r in mine):
            lines += ["", f"{stage} peak memory, MiB beyond the inputs (bwd: the forward, then the backward):",
                      f"{'case':<{width}}{'inputs':>10}" + "".join(f"{n:>{w}}" for n, w in zip(names, cols))]
            for c in cases:
                size = next((r["input_mib"] for r in mine if r["case"] == c and r.get("input_mib")), None)
                line = f"{c:<{width}}" + (f"{size:>10.0f}" if size else f"{'-':>10}")
                for n, w in zip(names, cols):
                    peak = (get.get((c, n)) or {}).get("peak_mib")
                    line += f"{peak:>{w}.0f}" if peak is not None else f"{'-':>{w}}"
                lines.append(line)
    notes: dict[tuple, list[str]] = {}               # the same note for several cases is said once
    for r in rows:
        if r["note"]:
            notes.setdefault((r["stage"], r["provider"], r["note"]), []).append(r["case"])
    if notes:
        lines += ["", "notes:"]
        for (stage, name, note), cases in notes.items():
            where = cases[0] if len(cases) == 1 else f"{len(cases)} cases"
            lines.append(f"  {stage} {where} / {name}: {note}")
    return "\n".join(lines)


def machine() -> dict:
    """What the rows were measured on: the GPU and the versions (docs/performance.md says them)."""
    import platform

    import torch
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA GPU)"
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__}


def write_json(rows: list[dict], path) -> None:
    """{device, python, torch, triton, rows}: rows of {stage, case, provider, ms, tflops, peak_mib,
    input_mib, note}, and the machine they were measured on."""
    with open(path, "w") as f:
        json.dump(dict(machine(), rows=[{k: r.get(k) for k in JSON_KEYS} for r in rows]), f, indent=1)
        f.write("\n")
