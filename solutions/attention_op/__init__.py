"""Stage 9's attention as a real PyTorch op: ``torch.compile``, CUDA graphs, low host overhead, and
the TMA kernels on Hopper.

What this package adds to stage 9
---------------------------------
Stage 9's ``attention`` is a plain ``autograd.Function`` around Triton kernels with
``triton.autotune``.  That works in eager mode and nowhere else: Dynamo cannot trace the
autotuner (it mutates its config list), Inductor recompiles the kernels with its own view of
the arguments, and every call re-validates its inputs and re-plans its launch in Python, which
costs more host time than a small GPU call takes.  This package keeps stage 9's kernels (but
for one hook, below), adds the faster TMA kernels where the GPU has them, and changes how they
are called:

* **The fastest kernels the GPU and the call allow.**  On a GPU of compute capability 9 (H100,
  H200) the op launches the TMA kernels of solutions/fast_forward_tma.py and
  fast_backward_tma.py when the head dim is a power of two, the dtype float16 or bfloat16, and
  the strides of q, k and v suit a TMA descriptor (last stride 1, start and other strides on 16
  bytes: a (B, N, H, D) tensor from a projection does); anything else goes to stage 9's
  kernels, which take any head dim and strides.  Neither copies an input; a dO that no
  descriptor can read (a ``.sum()`` loss gives one of stride 0) is copied where the TMA kernels
  serve q, k and v, so that such a backward takes them as a compiled graph does, with the same
  bits (and the C++ path, at a key's first call, lays out any dO as o: see native.py).  The backward's first
  kernel (delta and dsinks) is stage 9's either way, and a forward of one set and a backward of
  the other agree on o and lse.  On the same GPUs the forward of a long call may be stage 4's
  CUDA kernel with wgmma (solutions/fast_variable_block_wgmma.cu, any head dim a multiple of 8,
  every mask): its plan builds it and times it against the Triton forward once per shape, and
  keeps the faster.  The backward of such a call may likewise be the one-pass CUDA backward
  (solutions/fast_backward_wgmma.cu: head dims 64 and 128, N a multiple of 128), where its plan,
  made at the first backward, times a call with it faster (the host time it adds counted), unless
  deterministic algorithms are asked for.  ``plans.KERNELS`` can pin stage 9's kernels (or, for tests, the TMA kernels
  in Triton's CPU interpreter, or the wgmma kernels wherever they can run).

* **Two ``torch.library.triton_op`` ops**, ``workbook::attention_forward`` (q, k, v, sinks ->
  o, lse) and ``workbook::attention_backward`` (-> dq, dk, dv, dsinks), each launching the
  bare kernels through ``wrap_triton``, so ``torch.compile`` sees the kernels themselves (no
  graph break).  The wgmma kernels, CUDA behind ctypes, are ``custom_op``s of their own,
  ``workbook::wgmma_forward`` and ``workbook::wgmma_backward``, which the two ops call and a
  compiled graph keeps opaque.
  Each has a fake implementation that allocates the outputs exactly as the op does and
  launches nothing, so shapes, dtypes and strides are known without a GPU (Triton's CPU
  interpreter would otherwise try to run the kernels on fake tensors).
  ``register_autograd`` ties the two together.  The backward has no backward of its own.
* **Host-made descriptors in a compiled graph.**  The TMA kernels take their descriptors made
  on the host.  A traced ``wrap_triton`` launch would keep such a descriptor as a constant, with
  the traced call's addresses, so ``launch.op_launch`` puts each into the graph as the tensor it
  describes plus its tile, and the graph makes the descriptor over the buffer it has when it
  runs (tests/tools/traced_launches.py checks the traced graph).  Where this torch lacks what
  that needs, the kernels make their own.
* **Kernels that say what they write.**  Inductor learns which tensors a ``wrap_triton`` kernel
  writes by following each store's pointer back through the kernel's Triton IR, and it takes a
  helper's results as made from all of the helper's arguments.  A tensor it takes for written
  is copied before the kernel and back after it, and CUDA graphs are skipped when that tensor
  is a graph input ("mutated inputs").  So the query rows the forward stores o and lse through
  come from stage 5's ``_query_rows``, which takes no tensor, and are passed into
  ``_load_query_tile`` (which takes Q, K and V), never returned from it; a test
  (tests/tools/kernel_writes.py) checks the analysis's verdict for every kernel the ops launch.
* **Stage 9's kernels, one hook.**  Under ``torch.compile`` a Python float argument reaches a
  user kernel as float64, which would spread into the accumulators and break the compile; stage
  9's kernels (and the forward kernel it takes from stage 8) cast their scale arguments to
  float32 first, as the TMA kernels do.
* **A launch plan per shape, made outside tracing.**  The kernel set and the tile (BLOCK_M,
  BLOCK_N, warps, stages) of each kernel are chosen once per (shape, dtype, options): the
  table's first entry for short sequences, else the set's autotuners run once on random inputs
  of that shape, with every tracing mode switched off.  The plan is cached, so the compiler only
  ever meets a bare kernel with fixed meta-parameters, and eager calls skip the planning.
* **An SDPA-style entry**, :func:`attention`, with SDPA's argument names (``is_causal``,
  ``scale``, ``enable_gqa``), the workbook's ``window``, ``sink_tokens`` and ``sinks``, and an
  explicit ``layout``: ``"bhnd"`` (B, H, N, D) as in the workbook and SDPA, or ``"bnhd"``
  (B, N, H, D) as FlashAttention and most model code keep it.  ``"bnhd"`` is read through
  strides, never copied, and ``o`` comes back in the layout of ``q``.  Validation is cached per
  shape in eager mode; under ``torch.compile`` it runs once, while tracing.
* **Eager calls skip the dispatcher and Triton's binding.**  Plain tensors with no tracer or
  dispatch mode about go through an ``autograd.Function`` around the same two bodies;
  everything else goes through the ops.  Each eager call of a shape seen before launches the
  compiled kernels it kept (``_Launch``), skipping the argument binding Triton redoes on every
  launch.
* **Eager calls in C++ once their key is recorded.**  native.py records what the Python path
  launched for a call key (buffers, and each launch's function, grid and arguments: at the call
  without a gradient, at the first backward with one) and native.cpp repeats it from then on: one
  call into C++, the kernels launched through the driver (the wgmma forward through its own host
  function, which makes its tensor maps), one C++ autograd node.
  ``python -m grader bench host`` times its host time per call beside SDPA's and the Python
  path's in the same process (docs/stage9-notes.md).

A shape cannot tell the two layouts apart when they agree (B, 8, 8, D is either), so the
layout is a required statement, not a guess; what validation can catch, it does: a tensor
whose head count, sequence length, batch or head dim contradicts the others in the stated
layout is a ``ValueError`` that names the argument and the layout.

Where each part lives
---------------------

    plans.py     which kernels, and the tiles of each, one plan per (shape, dtype, options)
    launch.py    the forward and backward bodies, the kernels' launches and the compiled kernels kept
    library.py   the torch.library ops, their fake implementations and their autograd
    native.py    eager calls repeated in C++ (native.cpp): built on first use, plans recorded from launch.py
    api.py       attention(): the C++ path, else validation, then the eager path or the ops

Importing the package registers the ops, once per process (kernels.loader.load_package reaches
it from any folder; ``from solutions.attention_op import attention`` gets the same module).
``python -m grader bench host`` times its host overhead on a GPU (grader/bench/host.py).

Usage::

    o = attention(q, k, v, is_causal=True, window=128, sinks=sinks, enable_gqa=True, layout="bnhd")
    model = torch.compile(model, fullgraph=True)        # no graph break, CUDA graphs work too
"""

from .api import HEAD_DIMS, LAYOUTS, attention
from .library import attention_backward, attention_forward
from .plans import launch_plan, s9

__all__ = ["attention", "attention_forward", "attention_backward", "launch_plan", "LAYOUTS", "HEAD_DIMS",
           "s9"]       # s9: the stage 9 solution module whose kernels the op launches
