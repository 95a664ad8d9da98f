"""``python -m grader bench``: the stages' kernels timed against PyTorch's attention on a GPU.

    cases.py      the cases (shapes, masks, FLOP counts), their inputs, and each stage's providers
    providers.py  the ways of computing attention: a stage's solution, SDPA's backends, FlexAttention,
                  the instructors' fast variants
    verify.py     correctness before timing: outputs and gradients against the float64 reference
    measure.py    every provider checked, timed and its peak memory taken on every case (``bench STAGES``)
    tables.py     the rows as a table of TFLOP/s and ratios, and as JSON
    chart.py      the rows as a bar chart
    report.py     ``bench report``: docs/performance.md from the JSON
    train.py      ``bench train``: a gpt-oss-style training step with stage 9's op
    host.py       ``bench host``: the host time per call of stage 9's op at a small size

What a notebook needs is here: ``bench.run("stage4", source=..., providers=bench.learner_providers("stage4"))``
(the learner's kernel against PyTorch's, none of the instructors' variants) and ``bench.table(rows)``.
"""

from grader.bench.cases import CASES, Case, learner_providers, visible_pairs  # noqa: F401
from grader.bench.chart import plot  # noqa: F401
from grader.bench.measure import run  # noqa: F401
from grader.bench.tables import table, write_json  # noqa: F401
