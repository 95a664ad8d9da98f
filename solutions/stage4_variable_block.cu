// Stage 4: FlashAttention forward in CUDA, with tiles that follow the exact head dim.
//
// What you will learn
// -------------------
// * The tensor-core instruction itself: mma.sync.m16n8k16 multiplies a 16x16 tile of A by a
//   16x8 tile of B into a 16x8 float32 tile, one warp at a time.  Its step along the shared
//   (k) dimension is 16 and along the output columns (n) is 8, so a head dim only has to be
//   rounded to those steps, not to a power of two:
//
//       S = Q K^T   head dim is the k of the mma  ->  steps of 16  (72 is computed as 80)
//       O = P V     head dim is the n of the mma  ->  steps of 8   (72 is computed as 72)
//
// * How each thread of a warp holds its piece of a tile (the "fragment" layouts below), and
//   why the score tile S comes out of one mma already laid out as the A operand of the next:
//   P never leaves registers.
// * Reuse in registers: a warp owns M_TILES m-tiles of 16 query rows and multiplies every K or V
//   fragment it reads from shared memory into all of them.  Shared memory delivers 128 bytes per
//   clock per SM; with one m-tile per warp each mma needs 256 bytes of K or V, which starves the
//   tensor cores; with two it needs 128.
// * cp.async double buffering: while the warps multiply key/value block j, the copy engine
//   brings block j + 1 from global memory into the other half of shared memory.
// * The online softmax in registers: each row lives on the 4 threads of a "quad", so a row
//   max is two shuffles.
//
// The kernel is templated on HEAD_DIM, BLOCK_M, BLOCK_N and NUM_WARPS (and the dtype and causal
// flag); kernels/cuda_build.py compiles exactly the configuration plan_tiling picks, passing them
// as -DHEAD_DIM=.. -DBLOCK_M=.. -DBLOCK_N=.. -DNUM_WARPS=..  The file includes no PyTorch header:
// Python calls the plain C entry point at the bottom through ctypes, and `nvcc -c` checks it on
// machines without a GPU.
//
// Layout: one thread block per (query block, batch x head); warp w owns query rows
// [w * 16 * M_TILES, (w + 1) * 16 * M_TILES) of the block, M_TILES = BLOCK_M / (16 * NUM_WARPS).
// Shared memory, rows padded by 8 elements (16 bytes) so that the 8 row addresses of one
// ldmatrix land in 8 different bank groups:
//
//     sQ  [BLOCK_M][HEAD_DIM_PAD + 8]            loaded once; later reused to stage O
//     sK  [2][BLOCK_N][HEAD_DIM_PAD + 8]         two stages: compute on one, load the other
//     sV  [2][BLOCK_N][HEAD_DIM_PAD + 8]
//
// Columns HEAD_DIM .. HEAD_DIM_PAD of sQ and sK are zero (at most 8 of them), so the last
// 16-wide k-step of Q K^T adds nothing.
//
// What limits the kernel is the ldmatrix traffic out of shared memory, not the mma: the
// shared-memory pipe is busier than the tensor cores.  So a warp that owns two m-tiles, and
// reads each K and V fragment once for both, pays from D = 72 on, and plan_tiling picks that
// shape there (stage4_variable_block.py's candidate tiles).

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef HEAD_DIM          // the build passes the configuration; these defaults serve `nvcc -c`
#define HEAD_DIM 72
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif

namespace stage4 {

constexpr int MMA_M = 16;                 // m of mma.m16n8k16: query rows per m-tile
constexpr int MMA_K = 16;                 // k step: Q K^T runs over HEAD_DIM_PAD
constexpr int MMA_N = 8;                  // n step: P V runs over HEAD_DIM in steps of 8
constexpr int STAGES = 2;                 // K/V pipeline depth (double buffering)
constexpr int ROW_PAD = 8;                // elements added to each shared-memory row

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

template <int D, int BM, int BN, int WARPS>
struct Config {
    static_assert(D % 8 == 0 && D >= 8 && D <= 256, "HEAD_DIM must be a multiple of 8 from 8 to 256");
    static_assert(BM % (MMA_M * WARPS) == 0, "BLOCK_M must be a multiple of 16 x NUM_WARPS");
    static_assert(BN % 16 == 0, "BLOCK_N must be a multiple of 16 (P is the A operand: k = 16)");
    static constexpr int DP = round_up(D, MMA_K);          // head dim padded to the k step
    static constexpr int ROW = DP + ROW_PAD;               // shared-memory row, in elements
    static constexpr int M_TILES = BM / (MMA_M * WARPS);   // 16-row m-tiles per warp
    static constexpr int WARP_ROWS = M_TILES * MMA_M;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int CHUNKS = D / 8;                   // 16-byte chunks in one row of a tile
    static constexpr int SMEM_BYTES = (BM + 2 * STAGES * BN) * ROW * 2;   // float16 / bfloat16: 2 bytes
    // Registers: the queries stay in registers (read once) while they are few; 256-thread blocks
    // with a small head dim are held to 128 registers a thread so that two blocks share an SM,
    // one computing while the other waits for its tiles.
#ifdef Q_IN_REGS_OVERRIDE
    static constexpr bool Q_IN_REGS = Q_IN_REGS_OVERRIDE;
#else
    static constexpr bool Q_IN_REGS = M_TILES * DP <= 80;
#endif
#ifdef MIN_BLOCKS_OVERRIDE
    static constexpr int MIN_BLOCKS = MIN_BLOCKS_OVERRIDE;
#else
    static constexpr int MIN_BLOCKS = THREADS >= 256 && DP <= 96 ? 2 : 1;
#endif
};

struct Params {
    const void* q; const void* k; const void* v; void* o; float* lse;
    int64_t q_sb, q_sh, q_sn;             // strides in elements (the head-dim stride is 1)
    int64_t k_sb, k_sh, k_sn;
    int64_t v_sb, v_sh, v_sn;
    int64_t o_sb, o_sh, o_sn;
    int H, Nq, Nk;
    float scale_log2;                     // sm_scale * log2(e): exp(x * sm_scale) = exp2(x * scale_log2)
};

// ---- small wrappers around the PTX instructions ----------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; with valid = false it writes 16 zero bytes.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 tiles of 16-bit elements from shared memory; lane i gives the address of row i % 8
// of tile i / 8.  Thread t receives elements (row t / 4, columns 2 (t % 4) and +1) of each.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// The same, transposed: thread t receives (rows 2 (t % 4) and +1, column t / 4) of each tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

// d += a * b on the tensor cores, for one warp.  With g = lane / 4 and t = lane % 4:
//   a (16x16, 4 regs of 2 elements): a0 (row g, k 2t..2t+1)   a1 (row g+8, k 2t..)
//                                    a2 (row g, k 2t+8..)     a3 (row g+8, k 2t+8..)
//   b (16x8,  2 regs):               b0 (k 2t..2t+1, col g)   b1 (k 2t+8.., col g)
//   d (16x8,  4 floats):             d0, d1 (row g, cols 2t, 2t+1)   d2, d3 (row g+8, same cols)
template <typename T> struct Mma;
template <> struct Mma<__half> {
    __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};
template <> struct Mma<__nv_bfloat16> {
    __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

__device__ __forceinline__ float fast_exp2(float x) {     // exp2 on the special-function unit; exp2(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Copy rows [row0, row0 + ROWS) of one (batch, head) slice into shared memory, HEAD_DIM
// columns, 16 bytes per cp.async; rows past n_rows become zeros.
template <int ROWS, typename C, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t stride_n, int row0, int n_rows, int tid) {
    for (int c = tid; c < ROWS * C::CHUNKS; c += C::THREADS) {
        const int r = c / C::CHUNKS, col = (c % C::CHUNKS) * 8;
        const bool valid = row0 + r < n_rows;
        const T* src = valid ? g + (int64_t)(row0 + r) * stride_n + col : g;
        cp_async_16(s + r * C::ROW + col, src, valid);
    }
}

// ---- the kernel -------------------------------------------------------------------------

template <int D, int BM, int BN, int WARPS, typename T, bool CAUSAL>
__global__ void __launch_bounds__(Config<D, BM, BN, WARPS>::THREADS, Config<D, BM, BN, WARPS>::MIN_BLOCKS)
attention_kernel(const Params p) {
    using C = Config<D, BM, BN, WARPS>;
    constexpr int DP = C::DP, ROW = C::ROW, MT = C::M_TILES;
    constexpr int K_STEPS = DP / MMA_K;           // 16-wide steps of Q K^T over the padded head dim
    constexpr int S_TILES = BN / MMA_N;           // 8-wide column tiles of the score block
    constexpr int O_TILES = D / MMA_N;            // 8-wide column tiles of the output: exact head dim
    constexpr int P_STEPS = BN / MMA_K;           // 16-wide steps of P V over the keys

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BM * ROW;                        // [STAGES][BN][ROW]
    T* sV = sK + STAGES * BN * ROW;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;         // fragment coordinates (see Mma)
    // Causal query blocks near the bottom see the most keys: start those first, so the short ones
    // fill in the tail of the grid instead of leaving long ones running alone at the end.
    const int m0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    const T* k = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh;
    const T* v = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
    const int offset = p.Nk - p.Nq;               // causal, bottom-right: key j visible iff j <= i + offset

    // Key blocks this query block visits: all of them, or (causal) up to the last row's last key.
    const int n_end = CAUSAL ? min(p.Nk, m0 + BM + offset) : p.Nk;
    const int n_blocks = n_end > 0 ? (n_end + BN - 1) / BN : 0;

    // Zero the padding columns D..DP of every shared row once; cp.async never writes them.
    if constexpr (DP > D) {
        for (int r = tid; r < BM + 2 * STAGES * BN; r += C::THREADS)
            *reinterpret_cast<uint4*>(sQ + r * ROW + D) = make_uint4(0, 0, 0, 0);
    }
    load_tile<BM, C>(sQ, q, p.q_sn, m0, p.Nq, tid);
    if (n_blocks > 0) {
        load_tile<BN, C>(sK, k, p.k_sn, 0, p.Nk, tid);
        load_tile<BN, C>(sV, v, p.v_sn, 0, p.Nk, tid);
    }
    cp_async_commit();

    // This warp's rows: m-tile mt holds rows r0 + 16 mt + g (fragment elements 0, 1) and + 8 (2, 3).
    const int r0 = m0 + warp * C::WARP_ROWS;
    const T* qw = sQ + warp * C::WARP_ROWS * ROW;
    uint32_t qf[C::Q_IN_REGS ? MT : 1][C::Q_IN_REGS ? K_STEPS : 1][4];   // queries as A fragments
    float acc[MT][O_TILES][4];                    // unnormalised output, float32
    float m_i[MT][2], l_i[MT][2];                 // running max (raw scores) and sum (this thread's columns)
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_i[mt][0] = m_i[mt][1] = -INFINITY;
        l_i[mt][0] = l_i[mt][1] = 0.f;
        #pragma unroll
        for (int j = 0; j < O_TILES; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    }

    for (int nb = 0; nb < n_blocks; ++nb) {
        const int stage = nb % STAGES;
        const int n0 = nb * BN;
        cp_async_wait_all();
        __syncthreads();                          // block nb has landed; everyone is done with nb - 1
        if (nb + 1 < n_blocks) {                  // prefetch block nb + 1 into the other stage
            load_tile<BN, C>(sK + (1 - stage) * BN * ROW, k, p.k_sn, n0 + BN, p.Nk, tid);
            load_tile<BN, C>(sV + (1 - stage) * BN * ROW, v, p.v_sn, n0 + BN, p.Nk, tid);
        }
        cp_async_commit();
        const T* kt = sK + stage * BN * ROW;
        const T* vt = sV + stage * BN * ROW;
        if (C::Q_IN_REGS && nb == 0) {            // the warp's queries, from shared memory to registers, once
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int kk = 0; kk < (C::Q_IN_REGS ? K_STEPS : 0); ++kk)
                    ldmatrix_x4(qf[C::Q_IN_REGS ? mt : 0][C::Q_IN_REGS ? kk : 0],
                                qw + (mt * MMA_M + (lane % 8) + ((lane / 8) % 2) * 8) * ROW + kk * MMA_K + (lane / 16) * 8);
        }

        // TODO(4a): S = Q K^T for this warp's MT m-tiles and the BN keys of this block, in float32.
        // For each 16-wide k-step kk: the A fragment of each m-tile (qf[mt][kk] when C::Q_IN_REGS,
        // otherwise ldmatrix_x4 from qw at row 16 mt + (lane % 8) + ((lane / 8) % 2) * 8, column
        // 16 kk + (lane / 16) * 8).  Then for each pair of 8-key column tiles (2nn, 2nn + 1) one
        // ldmatrix_x4 from kt brings both B fragments: lane gives the address of key row
        // 16 nn + (lane % 8) + (lane / 16) * 8, column 16 kk + ((lane / 8) % 2) * 8; registers
        // {r0, r1} are tile 2nn and {r2, r3} tile 2nn + 1.  Multiply them into every m-tile.
        float s[MT][S_TILES][4];
        // BEGIN SOLUTION
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int j = 0; j < S_TILES; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (C::Q_IN_REGS) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) a[mt][e] = qf[C::Q_IN_REGS ? mt : 0][C::Q_IN_REGS ? kk : 0][e];
                } else {
                    ldmatrix_x4(a[mt], qw + (mt * MMA_M + (lane % 8) + ((lane / 8) % 2) * 8) * ROW + kk * MMA_K + (lane / 16) * 8);
                }
            }
            #pragma unroll
            for (int nn = 0; nn < S_TILES / 2; ++nn) {
                uint32_t r[4];
                ldmatrix_x4(r, kt + (nn * 16 + (lane % 8) + (lane / 16) * 8) * ROW + kk * MMA_K + ((lane / 8) % 2) * 8);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(s[mt][2 * nn], a[mt], r[0], r[1]);
                    Mma<T>::run(s[mt][2 * nn + 1], a[mt], r[2], r[3]);
                }
            }
        }
        // END SOLUTION

        // TODO(4b): the online softmax, per m-tile mt, for rows r0 + 16 mt + g (s[mt][j][0..1]) and
        // + 8 (s[mt][j][2..3]); this thread holds columns n0 + 8 j + 2 t and + 1.  If the block can
        // hold invisible keys (past Nk, or causal: key > row + offset), set those scores to -inf.
        // Then per row: the block max (reduce over the quad: __shfl_xor_sync with 1 and 2), m_new,
        // alpha = exp2((m_i - m_new) * scale_log2), p = exp2(s * scale_log2 - m_new * scale_log2)
        // in place of s, l_i = l_i * alpha + this thread's sum of p, acc *= alpha.  A row that
        // has seen only -inf has m_new = -inf: use 0 in its place so no exp2 sees -inf - -inf.
        // BEGIN SOLUTION
        const bool need_mask = n0 + BN > p.Nk || (CAUSAL && n0 + BN - 1 > m0 + offset);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (need_mask) {
                #pragma unroll
                for (int j = 0; j < S_TILES; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = n0 + j * MMA_N + 2 * t + (e & 1);
                        const int row = r0 + mt * MMA_M + g + (e >> 1) * 8;
                        if (col >= p.Nk || (CAUSAL && col > row + offset)) s[mt][j][e] = -INFINITY;
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = m_i[mt][i];
                #pragma unroll
                for (int j = 0; j < S_TILES; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * i], s[mt][j][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
                const float alpha = fast_exp2(m_i[mt][i] * p.scale_log2 - m_scaled);
                float sum = 0.f;
                #pragma unroll
                for (int j = 0; j < S_TILES; ++j) {
                    s[mt][j][2 * i] = fast_exp2(fmaf(s[mt][j][2 * i], p.scale_log2, -m_scaled));
                    s[mt][j][2 * i + 1] = fast_exp2(fmaf(s[mt][j][2 * i + 1], p.scale_log2, -m_scaled));
                    sum += s[mt][j][2 * i] + s[mt][j][2 * i + 1];
                }
                l_i[mt][i] = l_i[mt][i] * alpha + sum;
                m_i[mt][i] = mx;
                #pragma unroll
                for (int j = 0; j < O_TILES; ++j) { acc[mt][j][2 * i] *= alpha; acc[mt][j][2 * i + 1] *= alpha; }
            }
        }
        // END SOLUTION

        // TODO(4c): O += P V.  P's accumulator layout is already the A layout: for the 16-key step
        // kk and m-tile mt, a = {pack(s[mt][2kk][0], s[mt][2kk][1]), pack(s[mt][2kk][2], s[mt][2kk][3]),
        //                        pack(s[mt][2kk+1][0], ..[1]), pack(s[mt][2kk+1][2], ..[3])}.
        // V's B fragments come transposed (ldmatrix_x4_trans from vt: lane gives key row
        // 16 kk + (lane % 8) + ((lane / 8) % 2) * 8, column 16 dd + (lane / 16) * 8; {r0, r1} is
        // output tile 2dd, {r2, r3} tile 2dd + 1), each multiplied into every m-tile.  O_TILES =
        // D / 8 may be odd: do the last tile with ldmatrix_x2_trans at column 8 (O_TILES - 1).
        // Only the real head dim is computed.
        // BEGIN SOLUTION
        #pragma unroll
        for (int kk = 0; kk < P_STEPS; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            const T* vrow = vt + (kk * MMA_K + (lane % 8) + ((lane / 8) % 2) * 8) * ROW;
            #pragma unroll
            for (int dd = 0; dd < O_TILES / 2; ++dd) {
                uint32_t r[4];
                ldmatrix_x4_trans(r, vrow + dd * 16 + (lane / 16) * 8);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc[mt][2 * dd], a[mt], r[0], r[1]);
                    Mma<T>::run(acc[mt][2 * dd + 1], a[mt], r[2], r[3]);
                }
            }
            if constexpr (O_TILES % 2 == 1) {
                uint32_t r[2];
                ldmatrix_x2_trans(r, vrow + (O_TILES - 1) * MMA_N);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) Mma<T>::run(acc[mt][O_TILES - 1], a[mt], r[0], r[1]);
            }
        }
        // END SOLUTION
    }

    // Epilogue: O = acc / l through shared memory (this warp's own rows of sQ), then 16-byte
    // coalesced stores; lse = (m * scale_log2 + log2 l) * ln 2, or -inf for a row with no key.
    cp_async_wait_all();
    __syncthreads();
    T* so = sQ + warp * C::WARP_ROWS * ROW;
    // TODO(4d): finish each row: the full l is the sum over the quad (__shfl_xor_sync 1 and 2);
    // write acc[mt][j][2i..2i+1] * (1 / l) (0 when l == 0) as one packed pair at
    // so[(16 mt + g + 8 i) * ROW + 8 j + 2 t], and (lanes with t == 0, rows < Nq) lse at
    // p.lse[bh * Nq + row].
    // BEGIN SOLUTION
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            float l = l_i[mt][i];
            l += __shfl_xor_sync(0xffffffff, l, 1);
            l += __shfl_xor_sync(0xffffffff, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            #pragma unroll
            for (int j = 0; j < O_TILES; ++j)
                *reinterpret_cast<uint32_t*>(so + (mt * MMA_M + g + 8 * i) * ROW + j * MMA_N + 2 * t) =
                    Mma<T>::pack(acc[mt][j][2 * i] * inv, acc[mt][j][2 * i + 1] * inv);
            const int row = r0 + mt * MMA_M + g + 8 * i;
            if (t == 0 && row < p.Nq)
                p.lse[(int64_t)bh * p.Nq + row] = l > 0.f ? (m_i[mt][i] * p.scale_log2 + __log2f(l)) * 0.69314718055994531f
                                                          : -INFINITY;
        }
    }
    // END SOLUTION
    __syncwarp();
    T* o = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
    for (int c = lane; c < C::WARP_ROWS * C::CHUNKS; c += 32) {
        const int r = c / C::CHUNKS, col = (c % C::CHUNKS) * 8;
        if (r0 + r < p.Nq)
            *reinterpret_cast<uint4*>(o + (int64_t)(r0 + r) * p.o_sn + col) = *reinterpret_cast<const uint4*>(so + r * ROW + col);
    }
}

template <typename T, bool CAUSAL>
cudaError_t launch(const Params& p, int batch_heads, cudaStream_t stream) {
    using C = Config<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
    auto kernel = attention_kernel<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, T, CAUSAL>;
    if (C::SMEM_BYTES > 48 * 1024) {              // above 48 KB a kernel must ask for it
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
        if (err != cudaSuccess) return err;
    }
    dim3 grid((p.Nq + BLOCK_M - 1) / BLOCK_M, batch_heads);
    kernel<<<grid, C::THREADS, C::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace stage4

// ---- the C entry points Python calls (kernels/cuda_build.py) ------------------------------

extern "C" {

// HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, threads per block and dynamic shared memory of this build.
void stage4_config(int* out) {
    using C = stage4::Config<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
    out[0] = HEAD_DIM; out[1] = BLOCK_M; out[2] = BLOCK_N; out[3] = NUM_WARPS; out[4] = C::THREADS;
    out[5] = C::SMEM_BYTES;
}

const char* stage4_error_string(int code) {
    if (code == -1) return "the head dim does not match the head dim this kernel was compiled for";
    if (code == -2) return "unsupported dtype code (0: float16, 1: bfloat16)";
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// strides: 12 int64 in elements, (batch, head, row) for q, k, v, o; the head-dim stride is 1.
// dtype: 0 float16, 1 bfloat16.  Returns 0 or an error code for stage4_error_string.
int stage4_forward(const void* q, const void* k, const void* v, void* o, float* lse, const int64_t* strides,
                   int batch, int heads, int n_q, int n_k, int head_dim, float sm_scale, int dtype, int causal,
                   void* stream) {
    if (head_dim != HEAD_DIM) return -1;
    stage4::Params p;
    p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
    p.q_sb = strides[0]; p.q_sh = strides[1]; p.q_sn = strides[2];
    p.k_sb = strides[3]; p.k_sh = strides[4]; p.k_sn = strides[5];
    p.v_sb = strides[6]; p.v_sh = strides[7]; p.v_sn = strides[8];
    p.o_sb = strides[9]; p.o_sh = strides[10]; p.o_sn = strides[11];
    p.H = heads; p.Nq = n_q; p.Nk = n_k;
    p.scale_log2 = sm_scale * 1.4426950408889634f;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int bh = batch * heads;
    if (dtype == 0) return causal ? stage4::launch<__half, true>(p, bh, s) : stage4::launch<__half, false>(p, bh, s);
    if (dtype == 1) return causal ? stage4::launch<__nv_bfloat16, true>(p, bh, s)
                                  : stage4::launch<__nv_bfloat16, false>(p, bh, s);
    return -2;
}

}  // extern "C"
