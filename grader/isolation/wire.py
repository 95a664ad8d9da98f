"""The worker's replies, in a form the grader reads within bounds it sets itself.

Every message on the worker's two pipes is one frame: its length (``FRAME``, 8 bytes, big-endian),
then that many bytes.  A request is a pickle of the grader's own data.  A reply is one value (a
tuple such as ``("ok", result, seconds)``) written as

    8 bytes   the length of the JSON part, big-endian
    JSON      the value as a tree: JSON's own null, true, false, numbers and strings, and one-key
              objects for the rest: {"list": [...]}, {"tuple": [...]}, {"dict": [k1, v1, k2, v2, ...]},
              {"size": [...]}, {"dtype": "float32"}, {"complex": [re, im]} and
              {"tensor": [dtype, shape, order, offset]}
    data      the bytes of every tensor, each at its offset from the start of this part

A tensor is sent in the order of its dimensions in memory (``order``, outermost first), so a
transposed result comes back with its strides.

Why not torch.save: a pickle shares objects through its memo, so a few hundred bytes can describe
a list of lists a hundred levels deep with 2**100 paths through it, which any walk of the value
follows, or a dict keyed by such a tuple, which torch.load hashes while loading, exponentially in
the depth, in the grader's process.  JSON shares nothing: every part of the value costs bytes of
the reply, whose size the grader caps before it reads it, and ``decode`` also bounds the number of
parts, the depth, the length of every string and the bytes of the tensors, which may not overlap.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
import struct

MAX_PARTS = 100_000     # nodes of one value: far more than any result of a stage (a few tensors and numbers)
MAX_DEPTH = 32          # containers inside containers
MAX_TEXT = 8192         # characters of one string in a value; longer ones are cut
MAX_HEADER = 4 << 20    # bytes of JSON: a result's structure is small, its bulk is tensor bytes, and a few
                        # bytes of JSON can become a hundred of Python objects in the grader
MAX_DIMS = 16

DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "int8", "int16", "int32", "int64", "uint8", "bool")
ACCEPTED = "only tensors, numbers, strings, None, dtypes and lists, tuples or dicts of them"
_HEAD = struct.Struct("!Q")
_ATOMS = (str, int, float, bool, type(None))

FRAME = struct.Struct("!Q")     # a frame's length, before its bytes
CHUNK = 1 << 20                 # bytes moved per read or write of a pipe
#: Characters kept of an error's type name, message and traceback: the worker cuts them before it sends
#: them, and the grader again on receipt (the worker runs learner code, which may send anything).
NAME_CAP, MESSAGE_CAP, TRACEBACK_CAP = 200, 4000, 6000


class Refused(ValueError):
    """A value the grader does not accept, or a reply that is not one the worker's own code writes."""


def cut(text, limit: int) -> str:
    """``text`` (a learner's string, or anything, as str) at most ``limit`` characters long, saying what was cut."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f" ... [{len(text) - limit} more characters cut]"


def _type_name(obj) -> str:
    return cut(type(obj).__name__, 80)


# -- the worker's side --------------------------------------------------------------------

def encode(value) -> bytes:
    """``value`` as a reply's bytes; tensors are copied to the CPU.  Raises ``Refused`` for what
    ``decode`` would refuse (another type, too deep, too many parts)."""
    import torch
    chunks: list = []
    offset = 0

    def tensor(t):
        nonlocal offset
        if type(t) is not torch.Tensor:
            raise Refused(f"returned a {_type_name(t)} (a subclass of torch.Tensor), which the grader does not "
                          f"accept ({ACCEPTED})")
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise Refused(f"returned a tensor with layout {t.layout}, which the grader does not accept: "
                          "return plain (strided) tensors")
        name = str(t.dtype).replace("torch.", "")
        if name not in DTYPES:
            raise Refused(f"returned a tensor of dtype {name}; the grader accepts {', '.join(DTYPES)}")
        t = t.detach().to("cpu")
        # dimensions from the outermost in memory to the innermost (ties keep their order)
        order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        flat = t.permute(order).contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        node = {"tensor": [name, list(t.shape), order, offset]}
        chunks.append(data)
        offset += len(data)
        return node

    def split(x):
        if type(x) in _ATOMS:
            return None, x
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):     # numpy's integers, for one
            return None, int(x)
        if isinstance(x, numbers.Real) and not isinstance(x, torch.Tensor):
            return None, float(x)
        if isinstance(x, torch.Tensor):
            return None, tensor(x)
        if isinstance(x, torch.dtype):
            return None, {"dtype": str(x).replace("torch.", "")}
        if type(x) is complex:
            return None, {"complex": [x.real, x.imag]}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):     # e.g. a plan: its fields, as a dict
            x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        if isinstance(x, dict):
            return "dict", [y for pair in x.items() for y in pair]
        if type(x) in (list, tuple, torch.Size):
            return {list: "list", tuple: "tuple", torch.Size: "size"}[type(x)], list(x)
        raise Refused(f"returned a {_type_name(x)}, which the grader does not accept ({ACCEPTED})")

    tree = _walk(value, split, lambda kind, items: {kind: items}, MAX_PARTS, MAX_DEPTH)
    header = json.dumps(tree, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER:
        raise Refused(f"returned numbers and strings that take more than {MAX_HEADER >> 20} MiB to write, which "
                      "the grader does not accept: return tensors")
    return b"".join([_HEAD.pack(len(header)), header, *chunks])


# -- the grader's side ----------------------------------------------------------------------

def decode(data, *, max_parts: int = MAX_PARTS, max_depth: int = MAX_DEPTH, max_text: int = MAX_TEXT):
    """The value in a reply's bytes (a bytes-like object the grader has already capped in size).

    Every walk here is a loop over an explicit stack, bounded by ``max_parts`` and ``max_depth``;
    strings are cut at ``max_text`` characters; a tensor's bytes are its own (no two overlap, none
    reaches past the data).  Anything else raises ``Refused``."""
    import torch
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise Refused("sent the grader a reply too short to hold anything")
    (size,) = _HEAD.unpack(view[:_HEAD.size])
    if size > len(view) - _HEAD.size:
        raise Refused("sent the grader a reply whose parts do not add up")
    if size > MAX_HEADER:
        raise Refused(f"sent the grader more than {MAX_HEADER >> 20} MiB of numbers and strings")
    try:
        tree = json.loads(bytes(view[_HEAD.size:_HEAD.size + size]))
    except (ValueError, RecursionError):
        raise Refused("sent the grader a reply it cannot read") from None
    payload = view[_HEAD.size + size:]
    spans: list[tuple[int, int]] = []
    claimed = [0]      # bytes of the tensors so far: never more than the data, so copies of it are bounded

    def tensor(spec):
        if not (isinstance(spec, list) and len(spec) == 4):
            raise Refused("sent the grader a tensor it cannot read")
        name, shape, order, offset = spec
        if name not in DTYPES:
            raise Refused(f"sent the grader a tensor of an unknown dtype {cut(name, 40)!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(type(n) is int and n >= 0 for n in shape)):
            raise Refused("sent the grader a tensor with a shape it cannot read")
        if not (isinstance(order, list) and all(type(d) is int for d in order)
                and sorted(order) == list(range(len(shape)))):
            raise Refused("sent the grader a tensor with a layout it cannot read")
        dtype = getattr(torch, name)
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if type(offset) is not int or offset < 0 or offset + nbytes > len(payload):
            raise Refused("sent the grader a tensor whose bytes are not in the reply")
        claimed[0] += nbytes
        if claimed[0] > len(payload):
            raise Refused("sent the grader tensors whose bytes overlap")
        spans.append((offset, nbytes))
        inside = [shape[d] for d in order]
        try:
            if numel == 0:
                flat = torch.empty(inside, dtype=dtype)
            else:
                flat = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset).clone()
                flat = flat.view(dtype).view(inside)
        except (RuntimeError, OverflowError, ValueError) as exc:
            raise Refused(f"sent the grader a tensor it cannot rebuild ({cut(exc, 200)})") from None
        return flat.permute([order.index(d) for d in range(len(shape))])

    def split(x):
        if x is None or isinstance(x, (bool, int, float)):
            return None, x
        if isinstance(x, str):
            return None, cut(x, max_text)
        if not (isinstance(x, dict) and len(x) == 1):
            raise Refused("sent the grader a reply it cannot read")
        ((kind, body),) = x.items()
        if kind == "tensor":
            return None, tensor(body)
        if kind == "dtype":
            if body not in DTYPES:
                raise Refused(f"sent the grader an unknown dtype {cut(body, 40)!r}")
            return None, getattr(torch, body)
        if kind == "complex":
            if not (isinstance(body, list) and len(body) == 2 and all(type(v) in (int, float) for v in body)):
                raise Refused("sent the grader a complex number it cannot read")
            return None, complex(*body)
        if kind in ("list", "tuple", "size", "dict") and isinstance(body, list):
            return kind, body
        raise Refused("sent the grader a reply it cannot read")

    value = _walk(tree, split, _finish, max_parts, max_depth)
    spans.sort()
    for (a, n), (b, _) in itertools.pairwise(spans):
        if a + n > b:
            raise Refused("sent the grader tensors whose bytes overlap")
    return value


def _walk(top, split, finish, max_parts: int, max_depth: int):
    """``top`` rebuilt bottom-up, with a stack of its own instead of recursion.

    ``split(x)`` gives ``(None, y)`` for a leaf, rebuilt as ``y``, or ``(kind, children)`` for a
    container, rebuilt as ``finish(kind, rebuilt children)``.  Every node visited counts, so a value
    that reaches one list by many paths costs as much as the paths: more than ``max_parts`` nodes, or
    containers more than ``max_depth`` deep, raise ``Refused`` before any more work is done."""
    root: list = []
    stack: list = [(False, top, 0, root)]      # (False, node, depth, out) or (True, kind, children, out)
    parts = 0
    while stack:
        done, x, depth, out = stack.pop()
        if done:
            out.append(finish(x, depth))
            continue
        parts += 1
        if parts > max_parts:
            raise Refused(f"returned a value of more than {max_parts} parts, which the grader does not accept")
        if depth > max_depth:
            raise Refused(f"returned a value nested more than {max_depth} levels deep, which the grader does not "
                          "accept")
        kind, body = split(x)
        if kind is None:
            out.append(body)
            continue
        if parts + len(body) > max_parts:     # before the stack grows by them
            raise Refused(f"returned a value of more than {max_parts} parts, which the grader does not accept")
        children: list = []
        stack.append((True, kind, children, out))
        stack.extend((False, y, depth + 1, children) for y in reversed(body))
    return root[0]


def _finish(kind: str, items: list):
    """A container of ``kind`` from its decoded ``items`` (for a dict: keys and values in turn)."""
    import torch
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "size":
        if not all(type(n) is int for n in items):
            raise Refused("sent the grader a torch.Size that is not a tuple of ints")
        return torch.Size(items)
    if len(items) % 2:
        raise Refused("sent the grader a dict it cannot read")
    keys = items[0::2]
    for key in keys:     # hashing a key is then linear in its size
        if not (type(key) in _ATOMS or (type(key) is tuple and all(type(k) in _ATOMS for k in key))):
            raise Refused(f"returned a dict keyed by a {_type_name(key)}; the grader accepts keys that are "
                          "strings, numbers or tuples of them")
    return dict(zip(keys, items[1::2]))
