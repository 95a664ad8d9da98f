"""The reference solutions, one file per stage: plain Python that runs as it is
(``from solutions.stage5_causal import flash_attention``).

A later stage takes an earlier one's code as given code, an import marked ``# given``; release
writes the learner's file from the expansion, which holds that code itself (kernels/solution_file.py).
This package is the answer key: an edition never ships it, and the grader never lets stage code
import it.
"""
