"""What a traced graph holds of each kernel the ops launch: prints JSON, one entry a launch.

    python tests/tools/traced_launches.py [SOLUTIONS_DIR]

``torch.compile`` traces the ops' bodies outside Dynamo, and each ``wrap_triton`` launch becomes
a ``triton_kernel_wrapper_functional`` node of the graph.  The TMA kernels take descriptors made
on the host; in a graph each must be its tensor (a graph value, so that the compiled graph makes
the descriptor over the buffer it has when it runs) plus its tile in the node's
``tma_descriptor_metadata``, never a descriptor kept as a constant.  This traces a windowed call with
learned sinks, forward and backward, through the ops with the TMA kernels on the CPU, as far as
AOTAutograd's graphs (no kernel is compiled to machine code or run), and lists each launch (the
kernel, its descriptor metadata, which of those arguments are graph values, and which tensors
the graph clones because the kernel writes them) and any ``as_strided`` in the graph (a view
whose storage offset Inductor would have to get right).  It must run in a process of its own, for the
reason tests/tools/kernel_writes.py gives.  The trace is the CPU's on every machine: importing
compile_targets hides any GPU, so that the tiles are the ones the CPU plans.  ``WORKBOOK_TRACE_AS_FOUND=1`` leaves
torch's view of that (no device with host descriptors) as it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_targets  # hides any GPU and turns the interpreter off; its stand-in driver serves here too
import torch
from triton.runtime import driver

ROOT = compile_targets.ROOT


class _Traced(Exception):
    """Raised by the capturing compiler once the graphs are in hand: nothing is run."""


def main(solutions: Path) -> dict:
    driver.set_active(compile_targets._RecordingDriver())          # Triton IR for an H100
    if not os.environ.get("WORKBOOK_TRACE_AS_FOUND"):               # as torch finds things on an H100
        from torch.utils import _triton
        _triton.has_triton_tensor_descriptor_host_tma = lambda: True
    from kernels.loader import load_package

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    op = load_package(solutions / "attention_op")
    op.plans.KERNELS = "tma"                                        # the TMA kernels, as on an H100
    joint = []

    def partition(graph, *args, **kwargs):
        joint.append(graph)
        return default_partition(graph, *args, **kwargs)

    def stop(gm, example_inputs):
        raise _Traced

    backend = aot_autograd(fw_compiler=stop, bw_compiler=stop, partition_fn=partition)
    gen = torch.Generator().manual_seed(0)
    b, n, hq, hkv, d = 1, 128, 8, 2, 64
    q = torch.randn(b, n, hq, d, generator=gen).to(torch.float16).requires_grad_()
    k, v = (torch.randn(b, n, hkv, d, generator=gen).to(torch.float16).requires_grad_() for _ in range(2))
    sinks = torch.zeros(hq, requires_grad=True)

    def f(q, k, v, sinks):
        return op.attention(q, k, v, is_causal=True, window=32, sinks=sinks, enable_gqa=True, layout="bnhd")

    with op.native.off():
        try:
            torch.compile(f, backend=backend, fullgraph=True, dynamic=False)(q, k, v, sinks)
        except Exception as e:                                      # Dynamo wraps the compiler's exception
            if not isinstance(e, _Traced) and not isinstance(getattr(e, "inner_exception", None), _Traced):
                raise
    (graph,) = joint
    views = sorted({str(n.target) for n in graph.graph.nodes
                    if n.op == "call_function" and "as_strided" in str(n.target)})
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    launches = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or "triton_kernel_wrapper" not in str(node.target):
            continue
        kwargs = node.kwargs["kwargs"]
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        while not hasattr(kernel, "arg_names") or hasattr(kernel, "configs"):     # an autotuner around it
            kernel = kernel.fn
        tiles = node.kwargs["tma_descriptor_metadata"]
        launches.append({
            "kernel": kernel.__name__,
            "descriptors": {name: [meta[0], list(meta[1][0])] for name, meta in sorted(tiles.items())},
            "in_graph": sorted(name for name in tiles if isinstance(kwargs.get(name), torch.fx.Node)),
            "written": sorted(node.kwargs.get("tensors_to_clone", [])),
        })
    return {"launches": launches, "as_strided": views}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "solutions")))
