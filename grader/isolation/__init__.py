"""Learner code kept apart from the grader: the worker process, its sandbox, and what crosses between them.

Learner code runs only in a worker, a Python process of its own inside the strongest sandbox the
machine offers; the grader's process makes every verdict and never imports learner code.  What
each mechanism guarantees, and how that is tested, is in docs/isolation.md.

The worker's side, what runs inside the sandbox:

    child.py        the worker itself: limits, seccomp filter, guard, then one reply per request
    wire.py         the frames on the pipes, and the reply format the grader reads within bounds
    guard.py        early, friendly refusals, and the checks on inputs and outputs around each call
    harness.py      the grader's calls made in the worker beside the learner's (autograd, memory)
    limits.py       what learner code may spend (the grader reads it too, and enforces most of it)
    seccomp.py      the filter that refuses network sockets

The grader's side:

    runner.py       starts a worker in its sandbox, calls into it, enforces time, memory and output
    outcomes.py     how a call can end: the exceptions the checks catch, and words for a result
    mechanism.py    the mechanisms (bubblewrap, a dedicated user, none) and what each keeps out
    choice.py       which mechanism works here: asked for, probed, remembered
    sandbox.py      one worker's command line, environment, uid, cgroup and scratch folder
    view.py         what a bubblewrap worker's file system holds
    uids.py         a dedicated uid per worker, its own copies, and what it leaves behind
    answer_keys.py  the answer keys, and their modes taken away under the user mechanism
    caches.py       compile caches kept between gradings of your own files
    cgroups.py      a cgroup per worker: memory of every kind, and processes
    procfs.py       a worker's processes, memory and files, from /proc
    private.py      the grader's own temporary folder, and the records it keeps there
    files.py        reading files a learner controls, without trusting them

The sandbox shows the worker this whole folder, ``grader/__init__.py`` and ``kernels/`` (the
reference excepted), and nothing else of the workbook.  So the worker's side imports nothing from
the rest of ``grader``, this file imports nothing at all, and grader/__init__.py holds constants
only: tests/test_isolation.py follows the worker's imports to keep it so.
"""
