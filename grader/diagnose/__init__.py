"""Diagnoses: when an output is wrong, which known mistake explains it, and where it shows.

A fixed hint per check names the usual cause, which is often not this learner's.  Here the
learner's output is compared with the float64 reference *and* with the outputs of known wrong
variants, each computed in float64 from the same inputs: the lse in base 2, a missing rescale,
another softmax scale, a mask one key off, the wrong GQA head mapping, keys past N_K let in, ...
A variant explains the output when the output is as close to it as a right answer must be to
the reference (a few times the tolerance) and far from the reference.  The best-fitting
variant is the diagnosis; when none fits, there is none, and no cause is invented.  NaN is
diagnosed only where NaN occurred, and by which rows hold it.

    found = attention(o, lse, q, k, v, opts, allowed=(allowed_o, allowed_lse), block_m=..., block_n=...)
    if found: print(found.cause, found.message)

The modules:

    causes.py     every known cause by its stable name (CAUSES): its messages and the hole it is made in
    common.py     how well an output fits a variant, where an error shows
    dense.py      float64 attention with every knob a mistake can turn (masks from kernels/masks.py)
    nan.py        NaN in an attention's output, by the rows that hold it
    variants.py   the attention's wrong variants, family by family
    forward.py    attention(): a wrong (o, lse); explain_attention() for notebooks
    backward.py   gradients(): wrong dq, dk, dv, d(sinks); explain_gradients() for notebooks
    rowwise.py    softmax() and row_sum(): stages 1 and 2's row softmax and weighted row sum
"""

from grader.diagnose.backward import GRADIENT_VARIANTS, explain_gradients, gradients
from grader.diagnose.causes import CAUSES, Cause, Diagnosis, cause, headline, named, todo_of
from grader.diagnose.common import safely, uses_exp2
from grader.diagnose.forward import attention, explain_attention
from grader.diagnose.rowwise import row_sum, softmax

__all__ = ["CAUSES", "Cause", "Diagnosis", "GRADIENT_VARIANTS", "attention", "cause", "explain_attention",
           "explain_gradients", "gradients", "headline", "named", "row_sum", "safely", "softmax", "todo_of",
           "uses_exp2"]
