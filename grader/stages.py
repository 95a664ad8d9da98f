"""The workbook's stages: one row each, the single list the grader, release and tests share."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

from kernels.loader import ROOT


@dataclass(frozen=True)
class Stage:
    number: int
    module: str        # file name in stages/ and solutions/, without .py
    title: str
    notebook: str      # file name in notebooks/
    runs_on: str       # "CPU or GPU", or "GPU" where the kernel itself needs one

    @property
    def name(self) -> str:
        return f"stage{self.number}"

    @property
    def checks_module(self) -> str:
        return f"grader.checks.{self.name}"

    def checks(self):
        """The stage's checks: grader/checks/stageN.py, then any hidden ones in grader/checks/hidden/."""
        from grader.check import HIDDEN_PACKAGE, checks_of
        found = checks_of(importlib.import_module(self.checks_module))
        if (ROOT / "grader" / "checks" / "hidden" / f"{self.name}.py").exists():
            found += checks_of(importlib.import_module(f"{HIDDEN_PACKAGE}.{self.name}"))
        return found

    def files(self) -> list[str]:
        """The stage's files in stages/ (a .py, and a .cu beside it where the stage has one)."""
        names = [f"{self.module}.py"]
        if (ROOT / "solutions" / f"{self.module}.cu").exists():
            names.append(f"{self.module}.cu")
        return names


ALL: list[Stage] = [
    Stage(1, "stage1_online_softmax", "online softmax; tiled attention in PyTorch",
          "01_online_softmax.ipynb", "CPU or GPU"),
    Stage(2, "stage2_first_triton", "a first Triton kernel: program ids, pointers, masks, block loops",
          "02_first_triton.ipynb", "CPU or GPU"),
    Stage(3, "stage3_flash_forward", "FlashAttention forward in Triton; padding odd head dims",
          "03_flash_forward.ipynb", "CPU or GPU"),
    Stage(4, "stage4_variable_block", "variable-block tiling for odd head dims in CUDA", "04_variable_block.ipynb",
          "GPU (plan and emulation: CPU)"),
    Stage(5, "stage5_causal", "causal masking, block skipping, NaN-safe online softmax",
          "05_causal.ipynb", "CPU or GPU"),
    Stage(6, "stage6_gqa", "grouped-query and multi-query attention",
          "06_gqa.ipynb", "CPU or GPU"),
    Stage(7, "stage7_sliding_window", "sliding-window attention in O(N*W)",
          "07_sliding_window.ipynb", "CPU or GPU"),
    Stage(8, "stage8_sinks", "attention sinks: sink tokens and learned sinks",
          "08_sinks.ipynb", "CPU or GPU"),
    Stage(9, "stage9_backward", "the backward pass: dQ, dK, dV and d(sinks)", "09_backward.ipynb", "CPU or GPU"),
]


def _shipped(every: list[Stage]) -> list[Stage]:
    """The stages this copy holds: all of them, except in an edition made with ``release --to DIR
    --through stageN``, whose edition.json says it holds stages 1..N (the rest arrive by ``update``)."""
    try:
        through = json.loads((ROOT / "edition.json").read_text()).get("through")
    except (OSError, ValueError, AttributeError):
        return list(every)
    last = next((s.number for s in every if s.name == through), every[-1].number)
    return [s for s in every if s.number <= last]


#: The stages of this copy of the workbook, in order (``ALL`` lists every stage the workbook has).
STAGES: list[Stage] = _shipped(ALL)


def find(name: str) -> Stage:
    """A stage by 'stage3', '3' or its module name; otherwise a ValueError listing the stages
    (or, for a stage a later edition brings, saying so and how it will arrive)."""
    key = name.strip().lower()
    for stage in STAGES:
        if key in (stage.name, str(stage.number), stage.module):
            return stage
    for stage in ALL:
        if key in (stage.name, str(stage.number), stage.module):
            from grader import COMMAND
            raise ValueError(f"{stage.name} ({stage.title}) is not in this edition yet: this copy holds stages "
                             f"1-{STAGES[-1].number}. It arrives with a later edition of the workbook; when your "
                             f"instructor gives you one, {COMMAND} update --from <its folder> brings it in "
                             "without touching your work.")
    listing = ", ".join(f"{s.name} ({s.module})" for s in STAGES)
    raise ValueError(f"unknown stage {name!r}; the stages are: {listing}")
