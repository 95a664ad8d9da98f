"""A hostile worker: stage code that attacks the pipe between the worker and the grader.

Learner code runs in the worker, so it can write to the worker's pipes (``sys.argv`` names them),
with the worker's own functions (``_Pipes``, ``_pack``) or raw bytes.  Each attack below is a
stage 1 submission; the grader runs in a process of its own (so a grader that hangs fails its test
instead of stopping the suite) under every mechanism that works here, and each test asserts that
the grading ends within its limits, with the check's status and reason, and a record of bounded
size, and that the grader itself did not grow with what the worker sent.

The reply format itself (grader/isolation/wire.py) is attacked directly too: forged replies that
are deep, wide, cyclic in spirit (a DAG), or whose tensors overlap or reach past the data, are
refused at once, whatever a walk of them would cost.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass

from kernels.loader import ROOT

import pytest
import torch
from test_faults import IMPORT, RETURN, at
from test_hostile import FILE, STAGE1, TEMPLATE, _answer_keys_kept_as_they_were, indent  # noqa: F401 - a fixture

from grader.isolation import choice, wire
from grader.isolation.limits import Limits, reply_bytes
from grader.testing import mutants

MECHANISMS = ("bubblewrap", "user", "none")
# Every attack is stopped by something other than time, except the stalled reply: a time limit far
# beyond what any needs on a busy machine, so that only the attack can decide the status.
LIMITS = Limits(check_timeout=120, stage_timeout=240, memory_mb=1024, output_kb=256)
STALL_LIMITS = Limits(check_timeout=6, stage_timeout=60, memory_mb=1024, output_kb=256)
RECORD_BYTES = 64 * 1024       # a record of one or two checks, messages included, is far smaller
HUGE = 256 << 20               # what the huge reply streams: a quarter of the worker's memory limit

# The grader, in a process of its own: grades the folder and prints its result, how long it took and
# how much its own peak memory grew while grading.
DRIVER = """
import json, resource, sys, time
from grader import stages
from grader.grade import grade_stage
from grader.isolation.limits import Limits
folder, only, limits = sys.argv[1], json.loads(sys.argv[2]), Limits(**json.loads(sys.argv[3]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.monotonic()
result = grade_stage(stages.find("stage1"), folder, only=only, limits=limits, jobs=1)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(dict(result=result.to_dict(), seconds=time.monotonic() - began, grew_mb=grew / 1024)))
"""

# Inside online_softmax: the worker's own pipe writer, kept alive (a writer that is collected may
# close the worker's pipe).
PIPE = """
main = sys.modules["__main__"]
pipe = main._Pipes(int(sys.argv[1]), int(sys.argv[2]))
globals().setdefault("_KEEP", []).append(pipe)
"""
DAG = """
dag = []
for _ in range(64):
    dag = [dag, dag]          # 64 levels, 2**64 paths, a few hundred bytes pickled
"""
# name -> code run inside online_softmax (test_hostile's TEMPLATE)
DURING = {
    # a frame header's first bytes, then nothing: the grader must not wait on the rest for ever
    "stalled_header": "os.write(int(sys.argv[2]), b'\\0\\0\\0')\ntime.sleep(3600)",
    # a reply written by hand, with the worker's own encoding, holding a DAG of shared lists
    "forged_dag_reply": PIPE + DAG + "pipe.send_bytes(main._pack(('ok', dag, 0.0)))\ntime.sleep(3600)",
    # the same DAG, returned: the worker must not walk its 2**64 paths either
    "returned_dag": DAG + "return dag",
    # a reply in the grader's own format, written byte by byte: a list 40 levels deep
    "forged_deep_frame": PIPE + """
import struct
body = ('{"tuple":["ok",' + '{"list":[' * 40 + ']}' * 40 + ',0.0]}').encode()
pipe.send_bytes(struct.pack('!Q', len(body)) + body)
time.sleep(3600)
""",
    # an exception whose class name is 5 MiB (the message is cut, the name was not)
    "huge_type_name": "raise type('E' * (5 << 20), (Exception,), {})('boom')",
    # a reply as large as a quarter of the worker's memory, streamed with the worker's own framing
    "huge_reply": PIPE + f"pipe.send_bytes(bytes({HUGE}))\ntime.sleep(3600)",
    # a result the grader refuses (a class of the stage file's own, which a pickle could name): the
    # reason must be the grader's own, not torch's advice to load it with weights_only=False
    "tensor_subclass": ("import torch\nglobals()['Agreeable'] = type('Agreeable', (torch.Tensor,), {})\n"
                        "return torch.softmax(x.float(), -1).to(x.dtype).as_subclass(Agreeable)"),
}
# One unrequested frame per call, a copy of the right answer that the grader takes for the reply (so
# the check goes on), then the worker's own reply, 4 MiB of it: that fills the pipe, and the worker
# waits to write the rest while the grader waits to send the next call's q, k and v.
FLOOD = [(IMPORT, IMPORT + """import sys as _sys

_KEEP = []


def _flood(result):
    main = _sys.modules['__main__']
    if not _KEEP:
        _KEEP.append(main._Pipes(int(_sys.argv[1]), int(_sys.argv[2])))
    _KEEP[0].send_bytes(main._pack(('ok', result, 0.0)))
"""),
         (RETURN, "    _flood((o, lse))\n    return o, lse, torch.zeros(1 << 20)\n")]
TYPE_NAME_AT_IMPORT = at(IMPORT, IMPORT + "raise type('E' * (5 << 20), (Exception,), {})('boom')\n")


def _submission(tmp_path, attack: str):
    """A stage 1 folder for ``attack``: test_hostile's template, or an edited solution."""
    if attack in DURING:
        folder = tmp_path / attack
        folder.mkdir()
        (folder / FILE).write_text(TEMPLATE.format(root=str(ROOT), subs=str(tmp_path), out=str(tmp_path), file=FILE,
                                                   attack=indent(""), during=indent(DURING[attack])))
        return folder
    edits = FLOOD if attack == "flood" else TYPE_NAME_AT_IMPORT
    return mutants.build(STAGE1, mutants.Mutant(attack, attack, edits=edits), tmp_path / attack)


def _grade(mechanism: str, folder, only: list[str], limits: Limits) -> dict:
    why = choice.probe(mechanism)
    if why:
        pytest.skip(f"isolation {mechanism!r} is not available here: {why}")
    env = dict(os.environ, WORKBOOK_ISOLATION=mechanism, PYTHONUNBUFFERED="1")
    bound = limits.stage_timeout + 240      # the stage's limit, and starting Python, torch and a worker
    try:
        run = subprocess.run([sys.executable, "-c", DRIVER, str(folder), json.dumps(only), json.dumps(asdict(limits))],
                             check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bound)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the grader did not finish within {bound} s (its stage limit is {limits.stage_timeout} s): "
                    f"{(exc.stderr or b'')[-2000:]!r}")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    record = json.dumps(out["result"])
    assert len(record) < RECORD_BYTES, f"a record of {len(record)} bytes for {len(only)} check(s)"
    return out


@dataclass
class Attack:
    name: str
    only: list[str]            # the checks graded
    status: str                # each one's status
    says: tuple[str, ...]      # words each one's message holds
    lacks: tuple[str, ...] = ()
    limits: Limits = LIMITS


ATTACKS = [
    Attack("stalled_header", ["softmax_float16"], "timeout", ("part of a reply and stopped",), limits=STALL_LIMITS),
    # long before its time limit: the extra reply is found before the next request goes out
    Attack("flood", ["attention_matches_reference"], "FAIL", ("not asked for anything", "the worker was stopped")),
    Attack("forged_dag_reply", ["softmax_float16"], "FAIL", ("nested more than 32 levels deep",)),
    Attack("returned_dag", ["softmax_float16"], "FAIL", ("nested more than 32 levels deep",)),
    Attack("forged_deep_frame", ["softmax_float16"], "FAIL", ("nested more than 32 levels deep",)),
    Attack("huge_type_name", ["softmax_float16"], "FAIL", ("raised EEEE", "more characters cut", "boom")),
    Attack("huge_type_name_at_import", ["softmax_float16", "softmax_large_values"], "crash",
           ("could not be imported: EEEE", "more characters cut", "boom")),
    Attack("huge_reply", ["softmax_float16"], "crash", ("returned a result of 256 MiB, more than the 16 MiB",)),
    Attack("tensor_subclass", ["softmax_float16"], "FAIL", ("does not accept",), lacks=("weights_only", "torch.load")),
]


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_an_attack_on_the_pipe_fails_its_check_within_the_limits(attack, mechanism, tmp_path):
    out = _grade(mechanism, _submission(tmp_path, attack.name), attack.only, attack.limits)
    results = out["result"]["results"]
    assert sorted(r["name"] for r in results) == sorted(attack.only)
    for r in results:
        assert r["status"] == attack.status and r["earned"] == 0, r
        assert all(w in r["message"] for w in attack.says) and not any(w in r["message"] for w in attack.lacks), r
    # The grader's own peak memory grew by far less than the largest reply sent (HUGE): it holds no
    # more than a call's cap of what the worker sends.
    assert out["grew_mb"] < HUGE / 2**20 / 2, out["grew_mb"]


# -- the reply format, attacked directly (no worker) --------------------------------------------

def _frame(tree, data: bytes = b"") -> bytearray:
    header = json.dumps(tree).encode()
    return bytearray(struct.pack("!Q", len(header)) + header + data)


def test_what_a_stage_returns_comes_back_as_it_was():
    x = torch.randn(2, 3, 4).transpose(1, 2)                 # a strided result keeps its strides
    value = ("ok", (x, torch.tensor([True, False]), torch.zeros(0, 5), torch.tensor(2.5, dtype=torch.bfloat16)),
             {"dq_blocks": (64, 32), (1, "a"): [None, 1.5, float("inf"), "text"]}, torch.float16, torch.Size([1, 2]))
    back = wire.decode(bytearray(wire.encode(value)))
    (y, flags, empty, half), extra, dtype, size = back[1:]
    assert back[0] == "ok" and torch.equal(y, x) and y.stride() == x.stride()
    assert flags.tolist() == [True, False] and empty.shape == (0, 5) and half.dtype == torch.bfloat16
    assert extra == {"dq_blocks": (64, 32), (1, "a"): [None, 1.5, float("inf"), "text"]}
    assert dtype == torch.float16 and type(size) is torch.Size and size == (1, 2)


def test_a_dag_is_refused_by_the_worker_before_it_is_walked():
    dag: list = []
    for _ in range(200):
        dag = [dag, dag, dag]
    with pytest.raises(wire.Refused, match="nested more than 32 levels deep"):
        wire.encode(dag)
    wide: list = []
    for _ in range(20):
        wide = [wide] * 4          # 20 levels, 4**20 paths
    with pytest.raises(wire.Refused, match="more than 100000 parts"):
        wire.encode(wide)


@pytest.mark.parametrize("forged, says", [
    (_frame(json.loads('{"list": [' * 40 + ']}' * 40)), "nested more than 32 levels deep"),
    (bytearray(struct.pack("!Q", 80_010) + b"[" * 40_000 + b"]" * 40_000 + b"x" * 10), "cannot read"),
    (_frame({"list": [0] * 200_000}), "more than 100000 parts"),
    (_frame({"tensor": ["float32", [2**40], [0], 0]}, bytes(16)), "bytes are not in the reply"),
    (_frame({"tuple": [{"tensor": ["float32", [4], [0], 0]}, {"tensor": ["float32", [4], [0], 8]}]}, bytes(32)),
     "overlap"),
    (_frame({"list": ["x" * 1000] * 5000}), "more than 4 MiB of numbers and strings"),
    (_frame({"tensor": ["float32", [2, 2], [0, 0], 0]}, bytes(16)), "layout"),
    (_frame({"tensor": ["object", [1], [0], 0]}, bytes(16)), "unknown dtype"),
    (_frame({"dict": [{"list": []}, 1]}), "keyed by a list"),
    (_frame({"eval": "__import__('os')"}), "cannot read"),
    (bytearray(struct.pack("!Q", 2**60) + b"{}"), "do not add up"),
])
def test_a_forged_reply_is_refused(forged, says):
    with pytest.raises(wire.Refused, match=says):
        wire.decode(forged)


def test_tensors_that_share_bytes_are_refused_before_they_are_copied(monkeypatch):
    """The same 16 bytes a thousand times over (or a reply's 16 MiB): each tensor is a copy, so the
    grader must refuse at the first tensor past the data's size, not after making them all."""
    copies = []
    frombuffer = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: copies.append(k) or frombuffer(*a, **k))
    with pytest.raises(wire.Refused, match="overlap"):
        wire.decode(_frame({"list": [{"tensor": ["float32", [4], [0], 0]}] * 1000}, bytes(16)))
    assert len(copies) == 1


def test_strings_of_a_reply_are_cut():
    back = wire.decode(_frame({"tuple": ["error", "E" * (1 << 20), "m", "", 0.0]}))
    assert len(back[1]) < wire.MAX_TEXT + 100 and back[1].endswith(f"[{(1 << 20) - wire.MAX_TEXT} more characters cut]")
    with pytest.raises(wire.Refused, match="more than 4 MiB to write"):
        wire.encode(("ok", "E" * (5 << 20), 0.0))


def test_a_reply_may_hold_a_few_times_its_inputs_far_below_the_memory_limit():
    mib = 2**20
    assert reply_bytes(0, 8192) == 16 * mib                          # the floor: plans, numbers, small outputs
    assert reply_bytes(10 * mib, 8192) == 56 * mib                   # four times the inputs, and the floor
    assert reply_bytes(10_000 * mib, 8192) == 1024 * mib              # an eighth of the memory limit at most
    assert reply_bytes(10_000 * mib, 64) == 16 * mib                 # never below the floor
