"""Publishing: what goes from the instructor's workbook to learners.

    release.py   stages/ from solutions/ (the solution markers), and the learner's files kept safe
    edition.py   a learner's edition: its manifest, its updates, the audit that no answer ships early
    bundle.py    ``release --to DIR``: the learner's edition (or a Gradescope autograder) in a folder
    publish.py   ``publish stageN --to DIR``: a stage's reference solution, note and notebook added to it
    compare.py   ``stageN --compare``: the learner's code beside the published reference, hole by hole
    update.py    ``update --from DIR``: a newer edition taken into a learner's copy
"""
