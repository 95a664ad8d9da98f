"""Publishing: what goes from the instructor's workbook to learners.

    release.py   stages/ from solutions/ (the solution markers), and the learner's files kept safe
    edition.py   a learner's edition: its manifest, its updates, the audit that no answer ships early
    bundle.py    ``release --to DIR``: the learner's edition (or a Gradescope autograder) in a folder
    publish.py   ``publish stageN --to DIR``: a stage's reference solution, note and notebook added to it
    update.py    ``update --from DIR``: a newer edition taken into a learner's copy

Grading never imports this package: what it reads of an edition (edition.json, the ``.new``
files, the published reference for ``--compare``) is in grader/edition_info.py and
grader/compare.py, and the solution-file grammar release renders with is kernels/solution_file.py.
"""
