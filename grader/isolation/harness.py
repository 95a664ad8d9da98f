"""Calls the grader makes in the worker, beside the learner's functions: the ones that need autograd,
a kernel's own counters or device memory, none of which can cross from the worker to the grader.

Each helper takes the learner function it exercises first.  A check names that function and the
helper, with the keyword ``_harness``::

    ctx.learner.attention(q, k, v, do, causal=True, _harness="gradients")

and the worker (grader/isolation/child.py) calls ``gradients(stage.attention, q, k, v, do,
causal=True)``.  The grader thus records ``attention`` as the learner code the check ran (an
unfilled TODO it reaches makes the check ``todo``), and the stage file holds only what the learner
writes.  The notebooks call the same helpers directly, ``harness.backward_visits(
stage.flash_attention_backward, q, k, v)``.  The worker can read this file, as it can the rest of
grader/isolation/, but not the checks.
"""

from __future__ import annotations

import functools
import sys

from kernels import runtime, tuning

import torch

KEYWORD = "_harness"


def gradients(attend, q, k, v, do, *, sinks=None, **opts):
    """Run ``attend(q, k, v, ...)`` forward and ``o.backward(do)``; return ``(o, dq, dk, dv, dsinks)``."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    sinks = sinks.detach().requires_grad_(True) if sinks is not None else None
    o = attend(q, k, v, sinks=sinks, **opts)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad, (sinks.grad if sinks is not None else None)


def saved_for_backward(attend, q, k, v, **opts):
    """Shapes of every tensor ``attend``'s autograd node keeps for the backward (saved, or stored on ctx)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = attend(q, k, v, **opts)         # kept alive: a node's saved output is freed with the output
    node = o.grad_fn
    kept = [t for t in node.saved_tensors if t is not None]
    kept += [t for t in vars(node).values() if isinstance(t, torch.Tensor)]
    return [tuple(t.shape) for t in kept]


def backward_visits(backward, q, k, v, **opts):
    """Which tiles each backward kernel processes: ``backward(..., return_visits=True)``'s dict of visit
    counts (B, Hq, query blocks, key blocks) per kernel and tile shapes, after the same file's forward."""
    forward = sys.modules[backward.__module__].flash_attention
    o, lse = forward(q, k, v, **opts)
    *_, visits = backward(q, k, v, o, lse, torch.ones_like(o), return_visits=True, **opts)
    return visits


@tuning.untuned()       # one tile is enough to measure memory: no tile compiled only to be timed
def peak_memory(attend, *, n=32768, head_dim=128, batch=1, heads=8, kv_heads=8, dtype=torch.bfloat16,
                causal=True, window=None, sink_tokens=0, learned_sinks=True, verbose=True):
    """GPU only: peak memory of ``attend``'s forward + backward against the tensors it cannot avoid.

    Those are q, k, v, dO (inputs), o (output) and dq, dk, dv (gradients).  FlashAttention's
    promise is that nothing else of note is allocated; a budget of 1.2x their size allows for
    lse, delta and the allocator's rounding, and is three orders of magnitude below the Nq x Nk
    matrix a plain implementation would keep (n = 32768: 8 GiB per head in bf16).
    Returns a dict of byte counts.
    """
    if not runtime.ON_GPU:
        raise RuntimeError("peak_memory needs a CUDA GPU: the CPU interpreter does not track device memory")
    # What this process held before any of the calls below (earlier work, other checks) is not the
    # attention's; whatever the warm-up call leaves allocated still counts.
    torch.cuda.synchronize()
    elsewhere = torch.cuda.memory_allocated()
    g = runtime.manual_seed(0)
    q = runtime.randn(batch, heads, n, head_dim, dtype=dtype, generator=g).requires_grad_(True)
    k, v = (runtime.randn(batch, kv_heads, n, head_dim, dtype=dtype, generator=g).requires_grad_(True)
            for _ in range(2))
    do = runtime.randn(batch, heads, n, head_dim, dtype=dtype, generator=g)
    sinks = runtime.randn(heads, generator=g).requires_grad_(True) if learned_sinks else None
    opts = dict(causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks)
    attend(q, k, v, **opts).backward(do)                                  # compiles
    q.grad = k.grad = v.grad = None
    if sinks is not None:
        sinks.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    o = attend(q, k, v, **opts)
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - elsewhere
    needed = sum(t.numel() * t.element_size() for t in (q, k, v, do, o, q.grad, k.grad, v.grad))
    report = dict(peak_bytes=peak, needed_bytes=needed, held_before_bytes=elsewhere, budget_bytes=int(1.2 * needed),
                  quadratic_bytes=batch * heads * n * n * torch.finfo(dtype).bits // 8)
    if verbose:
        mib = 2 ** 20
        print(f"B{batch} Hq{heads} Hkv{kv_heads} N{n} D{head_dim} {dtype}: peak {peak / mib:.0f} MiB; "
              f"q, k, v, dO, o, dq, dk, dv take {needed / mib:.0f} MiB; budget 1.2x = {1.2 * needed / mib:.0f} MiB; "
              f"one N x N score matrix per head would be {report['quadratic_bytes'] / mib:.0f} MiB")
    return report


def compiled_gradients(attend, q, k, v, do, *, sinks=None, **opts):
    """``gradients`` of ``attend`` compiled whole: ``torch.compile(fullgraph=True)``, so a graph break
    is an error. Inductor on a GPU; on the CPU the ``aot_eager`` backend, which traces the same
    forward and backward graphs and runs them as they are, with no code to generate."""
    def step(q, k, v, sinks):
        return attend(q, k, v, sinks=sinks, **opts)

    compiled = torch.compile(step, fullgraph=True, backend=runtime.pick(cpu="aot_eager", gpu="inductor"))
    return gradients(lambda q, k, v, sinks=None: compiled(q, k, v, sinks), q, k, v, do, sinks=sinks)


def opcheck(op, *args, grad: bool = True):
    """``torch.library.opcheck(op, args)``: the operator's schema, fake implementation and autograd
    registration checked against its real runs (with ``grad``, floating-point tensors require grad,
    so that the autograd rule is exercised). Raises ``OpCheckError``, naming the test, on a
    mismatch; returns the names of the tests passed."""
    args = tuple(a.detach().requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    from grader.isolation import guard
    with guard.plain_allocations():
        return sorted(torch.library.opcheck(op, args))


HELPERS = {f.__name__: f for f in (gradients, saved_for_backward, backward_visits, peak_memory,
                                   compiled_gradients, opcheck)}


def bind(fn, name: str):
    """``fn`` (the learner function a check named) handed to the helper ``name``."""
    if name not in HELPERS:
        raise ValueError(f"the grader has no helper {name!r}; it has {sorted(HELPERS)}")
    return functools.partial(HELPERS[name], fn)
