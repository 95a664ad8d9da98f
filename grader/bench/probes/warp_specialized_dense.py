"""Probe: does Triton's automatic warp specialization give a dense forward cuDNN's speed on Hopper?

A minimal forward (2-D TMA descriptors, no window, no sinks, N a multiple of the tile) timed with and
without ``tl.range(..., warp_specialize=True)`` over a few tiles, beside SDPA's cuDNN backend.

    python grader/bench/probes/warp_specialized_dense.py      (a CUDA GPU; writes $OUT or /tmp/ws2d.json)

docs/hopper-notes.md says what it measured.
"""
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _block(acc, m_i, l_i, q, desc_k, desc_v, row, start_n, rows_m, offs_n, qk_scale, MASKED: tl.constexpr):
    k = desc_k.load([row + start_n, 0])
    s = tl.dot(q, k.T)
    if MASKED:
        s = tl.where(rows_m[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = desc_v.load([row + start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _fwd(desc_q, desc_k, desc_v, desc_o, N, qk_scale, CAUSAL: tl.constexpr, WS: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    row = tl.program_id(1) * N
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([row + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = start_m if CAUSAL else N
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        acc, m_i, l_i = _block(acc, m_i, l_i, q, desc_k, desc_v, row, start_n, rows_m, offs_n, qk_scale, False)
    if CAUSAL:
        for start_n in tl.range(start_m, start_m + BLOCK_M, BLOCK_N, warp_specialize=WS):
            acc, m_i, l_i = _block(acc, m_i, l_i, q, desc_k, desc_v, row, start_n, rows_m, offs_n, qk_scale, True)
    desc_o.store([row + start_m, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def run(q, k, v, causal, bm, bn, warps, stages, ws):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    dq, do_ = (TensorDescriptor.from_tensor(x.view(B * H * N, D), [bm, D]) for x in (q, o))
    dk, dv = (TensorDescriptor.from_tensor(x.view(B * H * N, D), [bn, D]) for x in (k, v))
    _fwd[(N // bm, B * H)](dq, dk, dv, do_, N, D ** -0.5 * 1.4426950408889634, CAUSAL=causal, WS=ws,
                           BLOCK_M=bm, BLOCK_N=bn, D=D, num_warps=warps, num_stages=stages)
    return o


def dense_cases():
    """The probes' four dense cases, B4 H16 N4096 bfloat16 at D64 and D128, causal and not: yields
    ``(D, causal, (q, k, v), flops, ref)`` with ref float32 SDPA's output."""
    for D, causal in itertools.product((64, 128), (False, True)):
        B, H, N = 4, 16, 4096
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * D * (N * (N + 1) / 2 if causal else N * N)
        yield D, causal, (q, k, v), flops, F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                           is_causal=causal)


def save_rows(path, rows: list[dict]) -> None:
    """The CUDA probes' JSON: the GPU's name, torch's, Triton's and nvcc's versions, and the rows."""
    from kernels import cuda_build
    nvcc = ".".join(map(str, cuda_build.nvcc_release() or ("not found",)))
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, nvcc=nvcc,
                       rows=rows), f, indent=1)


def main():
    out = os.environ.get("OUT", "/tmp")
    rows = []
    for D, causal, (q, k, v), flops, ref in dense_cases():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud = flops / do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                   rep=300, return_mode="median") / 1e9
        best = {}
        for ws in (False, True):
            for bm, bn, warps, stages in [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3),
                                          (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 4)]:
                try:
                    o = run(q, k, v, causal, bm, bn, warps, stages, ws)
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    t = flops / do_bench(lambda: run(q, k, v, causal, bm, bn, warps, stages, ws),
                                         rep=200, return_mode="median") / 1e9
                    print(f"D{D} causal={causal} ws={ws} {bm}x{bn} w{warps} s{stages}: {t:.0f} TFLOP/s "
                          f"err {err:.1e}", flush=True)
                    if err < 1e-2 and t > best.get(ws, (0,))[0]:
                        best[ws] = (round(t, 1), f"{bm}x{bn} w{warps} s{stages}")
                except Exception as e:
                    print(f"D{D} causal={causal} ws={ws} {bm}x{bn} w{warps} s{stages}: "
                          f"FAILED {repr(e)[:160]}", flush=True)
        rows.append(dict(D=D, causal=causal, cudnn=round(cud, 1), plain=best.get(False), ws=best.get(True)))
        json.dump(rows, open(f"{out}/ws2d.json", "w"), indent=1)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
