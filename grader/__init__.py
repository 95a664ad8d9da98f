"""The workbook's grader: ``python -m grader`` (grader/__main__.py parses; each command is a module's ``main``).

By role:

    grading      check.py, checks/, grade.py, grade_stages.py, progress.py, batch.py, formats.py,
                 holes.py, locate.py, diagnose/, notebook.py, sanitize.py, stages.py, compare.py
                 (--compare), edition_info.py (which edition this is); never publishing/
    set-up       doctor.py (what runs on this machine), setup_plan.py (setup.sh's choices)
    isolation/   the worker, its sandbox and what crosses between them (the sandbox shows the worker
                 that folder and this file, so this file holds constants only and imports nothing)
    publishing/  release, editions, bundles, published solutions, updates (the solution files' grammar
                 is kernels/solution_file.py, which grading reads too)
    bench/       timing against PyTorch SDPA and FlexAttention, its report and training step
    testing/     wrong solutions, the pytest bridge, the seed sweep
"""

#: What a learner types to run the grader, from the workbook's folder, with .venv activated or not
#: (the top-level ``workbook`` script runs .venv's Python).  Every message, README and notebook
#: prints this one command, so the command a learner copies is one that works.
COMMAND = "./workbook"

#: Where a batch's grading process (``python -m grader stageN --format json``) reads its learner's folder and
#: writes its record, in place of ``--submission`` and ``--out``: a process's environment is readable by its
#: own user alone (/proc/PID/environ), its command line by every local user (/proc/PID/cmdline).
BATCH_SUBMISSION_ENV, BATCH_OUT_ENV = "WORKBOOK_BATCH_SUBMISSION", "WORKBOOK_BATCH_OUT"
