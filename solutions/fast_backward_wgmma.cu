// The attention backward in one pass for Hopper (sm_90a), written with wgmma and the TMA: the
// fast path beside stage 9's three Triton kernels.  solutions/fast_backward_wgmma.py builds it
// and calls it; solutions/attention_op runs it where its plan times it faster than the TMA
// backward; grader/bench/probes/wgmma_backward.py builds the variants below and times them.
//
// What changes from stage 9, and why.  Stage 9 (and solutions/fast_backward_tma.py) computes dK
// and dV in one kernel and dQ in another, recomputing S and dP in each: seven matrix products a
// tile.  Here, as in FlashAttention-2 and -3, one kernel does five: each thread block owns
// BN = 64 x WARPGROUPS keys, keeps their K and V in shared memory, walks the query blocks
// (64 rows each) that see them and, per block,
//
//     S^T  = K Q^T            dP^T = V dO^T            (shared x shared)
//     P^T  = exp(scale S^T - lse)                      dS^T = P^T (dP^T - delta)
//     dV  += P^T dO           dK  += dS^T Q            (P^T and dS^T from registers)
//     dQ  += dS K             (dS^T through shared memory, read transposed; added into a
//                              float32 buffer that every key block of the row shares)
//
// Consumer warpgroup w owns keys 64 w .. 64 w + 63 of the block; for dQ the warpgroups split
// the head dim instead (w takes columns w D / 2 ..), so each reads both warpgroups' dS: a
// barrier between the consumers, and dS kept in two buffers so that the next block's can be
// written while the other warpgroup still reads this one.  A producer warpgroup (one thread)
// brings K and V once and Q, dO, lse and delta of each query block through a ring of STAGES.
//
// dQ's additions are what a one-pass backward pays for (docs/hopper-notes.md, sections 12-13).
// By default (BWD_DQ_TMA 2) the consumers only store dQ: each thread its own float32 fragments,
// in the order the registers hold them (conflict-free 16-byte stores, a warp's 512 bytes in a
// row), and a writer warp of the producer warpgroup hands each buffer to the bulk copy engine's
// reduce-add, which adds it, bytes in the same order, into the float32 buffer.  That buffer then
// holds dQ tile by tile in fragment order, and the caller puts it back in rows (a permutation:
// see fast_backward_wgmma.py).  Named barriers say when a buffer is full and when it is read.
// dQ's product is issued before dK's (BWD_DQ_EARLY), so that dQ is stored while dK multiplies.
// The other modes are the probe's, kept to time against: 0 vector atomics from the registers, 1
// the consumers' own TMA reduce-add of rows.
//
// GQA: a block owns 128 keys of one K/V head and walks every query head of its group, so dK and
// dV are summed over the group in registers.  Causal (bottom-right), a sliding window and sink
// tokens follow the workbook's rule (kernels/masks.py) and skip query blocks as stage 9's
// query_blocks_of does; learned sinks need nothing here (they are in lse, and their gradient is
// the preprocess's).  Causal grids of few blocks a head can be launched longest first (order 1),
// so that the longest blocks do not start last.  Q, K, V, dO are read through their strides by
// tensor maps, and dK, dV written through theirs.  Limits: N a multiple of 128, D 64 or 128.
// The wgmma and TMA helpers are the forward's (solutions/fast_variable_block_wgmma.cu), included without its kernels.

#include <type_traits>

#define STAGE4W_NO_FORWARD 1               // the forward's helpers, without compiling its kernels too
#include "fast_variable_block_wgmma.cu"

#ifndef BWD_STAGES
#define BWD_STAGES 2
#endif
#ifndef BWD_DQ_TMA                        // 0: vector atomics from the registers; 1: through shared memory
#define BWD_DQ_TMA 2                      // and the TMA's reduce-add, issued by the consumers; 2: through
#endif                                    // shared memory in fragment order, added by a writer warp
#ifndef BWD_DQ_BUFFERS                    // dQ buffers a warpgroup (with BWD_DQ_TMA): 1 or 2
#define BWD_DQ_BUFFERS 1
#endif
#ifndef BWD_DQ_EARLY                      // 1: dQ's product goes before dK's, and dQ is stored while dK runs
#define BWD_DQ_EARLY 1
#endif
#ifndef BWD_PREFETCH                      // 1: the next step's S^T is issued right after this step's dP^T,
#define BWD_PREFETCH 0                    // so that it multiplies while this step's P, dS and dQ are made
#endif                                    // (a probe variant: it waits for the next stage a step early)
#ifndef BWD_LEAVE_OUT                     // a diagnostic, wrong by design: 1 leaves out dQ's additions,
#define BWD_LEAVE_OUT 0                   // 2 its product too, so that their cost can be timed
#endif
#ifndef BWD_BF16_ONLY                     // 1: the bfloat16 kernels only, float16 refused (the compile tests
#define BWD_BF16_ONLY 0                   // of the probe's variants, whose differences no dtype touches)
#endif

namespace bwdw {
using namespace stage4w;

constexpr int CONSUMER_WARPGROUPS = 2;            // consumer warpgroups: they split dQ's columns between them

template <int D, int WG, int NS>
struct Config {
    static_assert(D % 64 == 0 && D <= 128, "the probe takes head dims 64 and 128");
    static_assert(WG == 2, "two consumer warpgroups");
    static_assert(!BWD_PREFETCH || D == 64, "BWD_PREFETCH: at D 128 the next step's S^T spills registers");
    static_assert(BWD_DQ_BUFFERS == 1 || BWD_DQ_BUFFERS == 2, "one or two dQ buffers a warpgroup");
    static constexpr int BN = 64 * WG;                  // keys a block
    static constexpr int BM = 64;                       // queries a step
    static constexpr int PANELS = D / 64;
    static constexpr int CONSUMERS = 128 * WG;
    static constexpr int THREADS = CONSUMERS + 128;
    // setmaxnreg only moves registers within the block's launch allocation (ptxas gives each thread
    // the most __launch_bounds__ allows, 168 here): a consumer asking for more than is left waits forever.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int POOL = 65536 / THREADS / 8 * 8 * THREADS;
    static constexpr int FIT = (POOL - 128 * PRODUCER_REGS) / CONSUMERS / 8 * 8;
    static constexpr int CONSUMER_REGS = FIT > 240 ? 240 : FIT;
    static_assert(128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= POOL, "setmaxnreg asks for more than the block has");
    static constexpr int KV_BYTES = PANELS * BN * 128;  // K or V of the block
    static constexpr int Q_BYTES = PANELS * BM * 128;   // Q or dO of a query block
    static constexpr int DS_BYTES = BN * 128;           // dS^T: BN key rows of 64 queries
    static constexpr int STAT_BYTES = BM * 4;           // lse or delta of a query block
    static constexpr int DQ_BYTES = BWD_DQ_TMA ? BM * (D / 2) * 4 : 0;   // a warpgroup's float32 dQ columns
    static constexpr int SMEM_BYTES = 2 * KV_BYTES + NS * 2 * Q_BYTES + 2 * DS_BYTES + NS * 2 * STAT_BYTES +
                                      BWD_DQ_BUFFERS * WG * DQ_BYTES + 1024;
};

struct Params {
    CUtensorMap tm_q, tm_k, tm_v, tm_do;   // (D, N, H, B) views, boxes of 64 columns
    CUtensorMap tm_dq;                     // float32 (D, Nq, H, B), boxes of D / 2 columns x 64 rows
    const float* lse;                      // (B H, Nq), natural log
    const float* delta;                    // (B H, Nq): rowsum(dO * O)
    float* dq;                             // (B H, Nq, D) float32, zeroed; gets dS K (unscaled)
    void* dk;                              // (B, Hkv, Nk, D) through dk_stride, dv_stride: (batch, head, row)
    void* dv;
    int64_t dk_stride[3], dv_stride[3];
    int H, Hkv, Nq, Nk;                    // query heads, K/V heads (H a multiple)
    int window, sink_tokens;               // (with causal) a window of this many keys, 0 for none; sink tokens
    int order;                             // 1: causal key blocks longest first, dense ones staggered
    float scale, scale_log2;
};

// d (+)= A B with A and B both read transposed (MN-major) from shared memory.
template <int N, typename T> struct WgmmaT;
#define BWDW_WGMMA_T(N, G, T, TY)                                                                        \
    template <> struct WgmmaT<N, T> {                                                                   \
        __device__ __forceinline__ static void ss(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n"                                    \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                 \
                         "{" WG_SS_##G "}, %0, %1, p, 1, 1, 1, 1;\n}\n"                                  \
                         : "+l"(da), "+l"(db), "+r"(acc), WG_D_##G);                                     \
        }                                                                                               \
    };
BWDW_WGMMA_T(32, 4, __half, "f16") BWDW_WGMMA_T(32, 4, __nv_bfloat16, "bf16")
BWDW_WGMMA_T(64, 8, __half, "f16") BWDW_WGMMA_T(64, 8, __nv_bfloat16, "bf16")

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}

// Named barriers 2 .. between the consumers and the writer warp (0 is __syncthreads, 1 the consumers'):
// FULL(buffer, warpgroup) when a dQ buffer is stored, EMPTY(buffer, warpgroup) when it has been read.
constexpr int DQ_FULL = 2, DQ_EMPTY = 2 + 2 * CONSUMER_WARPGROUPS;
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void tma_reduce_add(const CUtensorMap* map, uint32_t src, int col, int row, int h, int b) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(map), "r"(src), "r"(col), "r"(row), "r"(h), "r"(b) : "memory");
}

template <typename T>
__device__ __forceinline__ void store_pair(void* base, int64_t index, float a, float b) {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(base) + index) = pack<T>(a, b);
}

template <int D, int WG, int NS, typename T, bool CAUSAL>
__global__ void __launch_bounds__(Config<D, WG, NS>::THREADS, 1)
backward_kernel(const __grid_constant__ Params p) {
    using C = Config<D, WG, NS>;
    constexpr int BN = C::BN, BM = C::BM, PANELS = C::PANELS, DH = D / 2;
    constexpr float LOG2E_F = 1.4426950408889634f;

    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[1 + 2 * NS];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const uint32_t sK = base, sV = sK + C::KV_BYTES;
    const uint32_t sQ = sV + C::KV_BYTES;                 // [NS][PANELS][BM rows][128 bytes]
    const uint32_t sdO = sQ + NS * C::Q_BYTES;
    const uint32_t sdS = sdO + NS * C::Q_BYTES;           // [2][BN rows][128 bytes]
    const uint32_t sStat = sdS + 2 * C::DS_BYTES;         // [NS][lse BM | delta BM] floats
    const uint32_t sDQ = sStat + NS * 2 * C::STAT_BYTES;  // [BWD_DQ_BUFFERS][WG][BM rows][D / 2] float32
    const float* stat = reinterpret_cast<const float*>(smem_raw + (sStat - raw));
    const uint32_t bar_kv = smem_addr(&bars[0]);
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + NS + s]); };

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int linear = blockIdx.x + blockIdx.y * gridDim.x;
    const bool longest_first = p.order && CAUSAL;
    const int n0 = (longest_first ? linear / gridDim.y : blockIdx.x) * BN;
    const int bkv = longest_first ? linear % gridDim.y : blockIdx.y;   // (batch, K/V head)
    const int b = bkv / p.Hkv, hkv = bkv % p.Hkv, group = p.H / p.Hkv;
    const int offset = p.Nk - p.Nq;
    // The query rows [lo, hi) that see a key of this block, and [full_lo, full_hi) that see all of
    // them, as stage 9's query_blocks_of: causal from the diagonal down; a window ends where the
    // block's last key leaves it, unless the block holds sink tokens.
    int lo = 0, hi = p.Nq, full_lo = 0, full_hi = p.Nq;
    if (CAUSAL) {
        lo = max(n0 - offset, 0) / BM * BM;
        full_lo = min((max(n0 + BN - 1 - offset, 0) + BM - 1) / BM * BM, hi);
        if (p.window > 0) {
            hi = n0 < p.sink_tokens ? p.Nq : min(n0 + BN - 1 - offset + p.window, p.Nq);
            full_lo = min(full_lo, hi);
            full_hi = max(min(max(n0 - offset + p.window, 0) / BM * BM, hi), full_lo);
        }
    }
    const int first = lo / BM;                            // the first query block that sees a key here
    const int n_m = max(0, (hi + BM - 1) / BM - first);   // query blocks a query head
    const int n_iters = group * n_m;                      // steps: every query head of the group, block by block
    const int turn = p.order && !CAUSAL ? (int)((int64_t)blockIdx.x * n_m / gridDim.x) : 0;
    auto block_at = [&](int mi) {                 // the query block of step mi of a head: first + (mi + turn) mod n_m
        const int k = mi + turn;
        return first + (k >= n_m ? k - n_m : k);
    };
    // Each loop walks the steps as (query head of the group gh, block mi), counting both.
    auto next = [&](int& gh, int& mi) { if (++mi == n_m) { mi = 0; ++gh; } };
    auto rows_of = [&](int gh) { return (int64_t)(b * p.H + hkv * group + gh) * p.Nq; };   // lse, delta, dQ row 0

    if (tid == 0) {
        mbar_init(bar_kv, 1);
        for (int s = 0; s < NS; ++s) { mbar_init(full(s), 1); mbar_init(empty(s), C::CONSUMERS / 32); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp < 4) {                                       // the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(C::PRODUCER_REGS));
        if (warp == 0 && lane == 0) {
            mbar_expect_tx(bar_kv, 2 * C::KV_BYTES);
            for (int c = 0; c < PANELS; ++c) {
                tma_load(sK + c * BN * 128, &p.tm_k, 64 * c, n0, hkv, b, bar_kv);
                tma_load(sV + c * BN * 128, &p.tm_v, 64 * c, n0, hkv, b, bar_kv);
            }
            for (int it = 0, gh = 0, mi = 0; it < n_iters; ++it, next(gh, mi)) {
                const int s = it % NS, m = block_at(mi) * BM, hq = hkv * group + gh;
                mbar_wait(empty(s), ((it / NS) & 1) ^ 1);
                mbar_expect_tx(full(s), 2 * C::Q_BYTES + 2 * C::STAT_BYTES);
                for (int c = 0; c < PANELS; ++c) {
                    tma_load(sQ + s * C::Q_BYTES + c * BM * 128, &p.tm_q, 64 * c, m, hq, b, full(s));
                    tma_load(sdO + s * C::Q_BYTES + c * BM * 128, &p.tm_do, 64 * c, m, hq, b, full(s));
                }
                bulk_load(sStat + s * 2 * C::STAT_BYTES, p.lse + rows_of(gh) + m, C::STAT_BYTES, full(s));
                bulk_load(sStat + s * 2 * C::STAT_BYTES + C::STAT_BYTES, p.delta + rows_of(gh) + m,
                          C::STAT_BYTES, full(s));
            }
        } else if (BWD_DQ_TMA == 2 && !BWD_LEAVE_OUT && warp == 1) {
            // The writer: each stored buffer into the float32 dQ by the reduce-add, then, once the
            // engine has read a buffer that the consumers will use again, tell them so.
            constexpr int NB = BWD_DQ_BUFFERS;
            for (int it = 0, gh = 0, mi = 0; it < n_iters; ++it, next(gh, mi)) {
                const int buf = it % NB;
                float* tile = p.dq + (rows_of(gh) + block_at(mi) * BM) * D;
                for (int w = 0; w < WG; ++w) {
                    named_sync(DQ_FULL + buf * WG + w, 128 + 32);
                    if (lane == 0) {
                        bulk_reduce_add(tile + w * BM * DH, sDQ + (buf * WG + w) * C::DQ_BYTES, C::DQ_BYTES);
                        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    }
                }
                if (lane == 0) {
                    if (NB == 1) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    else asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(WG) : "memory");
                }
                __syncwarp();
                const int read = it - (NB - 1);           // the iteration whose buffers are now read
                if (read >= 0 && read + NB < n_iters)     // ... and will be stored again
                    for (int w = 0; w < WG; ++w) named_arrive(DQ_EMPTY + (read % NB) * WG + w, 128 + 32);
            }
            if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(C::CONSUMER_REGS));
    const int wg = warp / 4 - 1, w4 = warp % 4, g = lane / 4, t = lane % 4;
    const int krow = 64 * wg + 16 * w4 + g;               // this thread's key rows: krow, krow + 8
    float dv[D / 2], dk[D / 2];
    #pragma unroll
    for (int j = 0; j < D / 2; ++j) { dv[j] = 0.f; dk[j] = 0.f; }

    // K-major tiles (the head dim along the 128-byte rows), as the forward's Q and K: step kk
    // reads 16 columns.  Transposed reads (the MN-major A or B) take 16 rows a step, panels
    // LBO apart.
    auto rows_desc = [&](uint32_t tile, int rows, int first_row, int kk) {
        return descriptor(tile + (kk / 4) * rows * 128 + first_row * 128 + (kk % 4) * 32, 16, 1024);
    };
    auto cols_desc = [&](uint32_t tile, int rows, int kk) { return descriptor(tile + kk * 2048, rows * 128, 1024); };
    const int c0 = wg * DH;                               // this warpgroup's dQ columns
    // The window in keys (none: wider than any row), and which of this thread's two key rows are sink tokens.
    const int window = p.window > 0 ? p.window : 1 << 30;
    const bool sink_row[2] = {n0 + krow < p.sink_tokens, n0 + krow + 8 < p.sink_tokens};
    const uint32_t sK_dq = sK + (c0 / 64) * BN * 128 + (c0 % 64) * 2;

    // S^T of the step whose Q lies in stage s: keys of this warpgroup against the stage's queries.
    auto issue_s = [&](float (&acc)[BM / 2], int s) {
        const uint32_t q_t = sQ + s * C::Q_BYTES;
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) Wgmma<BM, T>::ss(acc, rows_desc(sK, BN, 64 * wg, kk), rows_desc(q_t, BM, 0, kk), kk > 0);
        wgmma_commit();
    };
    mbar_wait(bar_kv, 0);
    // With BWD_PREFETCH a step's S^T is multiplied into st_next (the first step's here, each
    // other's by the step before) and copied into st when the step begins: st itself is never an
    // accumulator, so that ptxas serializes no product (it does add fences around the copy).
    float st[BM / 2];
    [[maybe_unused]] float st_next[BM / 2];
    if (BWD_PREFETCH && n_iters > 0) {
        mbar_wait(full(0), 0);
        wgmma_fence();
        issue_s(st_next, 0);
    }
    // One step; ``ahead`` (a type, so that every wait matches its issues in the code ptxas sees):
    // whether it issues the next step's S^T.
    int it = 0, gh = 0, mi = 0;                           // the step, and its query head and block
    auto step = [&](auto ahead_t) {
        const int s = it % NS, buf = it & 1, m = block_at(mi) * BM, hq = hkv * group + gh;
        const uint32_t q_t = sQ + s * C::Q_BYTES, do_t = sdO + s * C::Q_BYTES;
        constexpr bool ahead = decltype(ahead_t)::value;  // the next step's S^T is issued in this one
        float dpt[BM / 2];
        mbar_wait(full(s), (it / NS) & 1);
        if constexpr (BWD_PREFETCH != 0) {               // this step's S^T, issued before it began
            wgmma_wait<0>();
            hold(st_next);
            #pragma unroll
            for (int j = 0; j < BM / 2; ++j) st[j] = st_next[j];
        }
        wgmma_fence();
        if (!BWD_PREFETCH) issue_s(st, s);
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) Wgmma<BM, T>::ss(dpt, rows_desc(sV, BN, 64 * wg, kk), rows_desc(do_t, BM, 0, kk), kk > 0);
        wgmma_commit();
        if constexpr (ahead) {
            const int s1 = (it + 1) % NS;
            mbar_wait(full(s1), ((it + 1) / NS) & 1);
            issue_s(st_next, s1);
        }
        const float* lse = stat + s * 2 * BM;
        const float* delta = lse + BM;
        // S^T done (with BWD_PREFETCH it was when the step began, and these waits retire nothing);
        // dP^T, and the next step's S^T, may run on.
        if constexpr (ahead) wgmma_wait<2>();
        else wgmma_wait<1>();
        hold(st);
        // P^T = exp2(S^T scale log2(e) - lse log2(e)), then, in blocks that the rule cuts, the
        // workbook's rule (causal, and in the window or a sink token) by bitwise tests and a select.
        // One uniform branch picks the loop, so nothing branches per element while dP multiplies.
        auto probabilities = [&](auto masked) {
            #pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 l2 = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t);
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = fast_exp2(fmaf(st[4 * j + e], p.scale_log2, -((e & 1) ? l2.y : l2.x) * LOG2E_F));
                    if constexpr (decltype(masked)::value) {
                        const int key = n0 + krow + (e >> 1) * 8, diag = m + 8 * j + 2 * t + (e & 1) + offset;
                        const bool seen = (key <= diag) & ((key > diag - window) | sink_row[e >> 1]);
                        st[4 * j + e] = seen ? x : 0.f;
                    } else {
                        st[4 * j + e] = x;
                    }
                }
            }
        };
        if (CAUSAL && !(m >= full_lo && m + BM <= full_hi)) probabilities(std::true_type{});
        else probabilities(std::false_type{});
        if constexpr (ahead) wgmma_wait<1>();
        else wgmma_wait<0>();
        hold(dpt);
        #pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
            #pragma unroll
            for (int e = 0; e < 4; ++e) dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        }
        uint32_t pa[BM / 16][4], da[BM / 16][4];
        #pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                pa[kk][r] = pack<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
                da[kk][r] = pack<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
            }
        // dS^T into shared memory: key row r, 16-byte chunk j (queries 8 j ..) at chunk j ^ (r % 8).
        #pragma unroll
        for (int j = 0; j < BM / 8; ++j)
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const uint32_t a = sdS + buf * C::DS_BYTES + (krow + 8 * i) * 128 + ((j ^ g) * 16) + 4 * t;
                asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(a), "r"(da[j / 2][(j % 2) * 2 + i]));
            }
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) Wgmma<D, T>::rs(dv, pa[kk], cols_desc(do_t, BM, kk));
        if (!BWD_DQ_EARLY) {
            #pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) Wgmma<D, T>::rs(dk, da[kk], cols_desc(q_t, BM, kk));
        }
        wgmma_commit();
        float dq[DH / 2];
        if (BWD_LEAVE_OUT < 2) {
            fence_async_smem();                           // dS^T written, then read by the async proxy
            asm volatile("bar.sync 1, %0;\n" :: "n"(C::CONSUMERS) : "memory");
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                WgmmaT<DH, T>::ss(dq, cols_desc(sdS + buf * C::DS_BYTES, BN, kk), cols_desc(sK_dq, BN, kk), kk > 0);
            wgmma_commit();
        }
        if (BWD_DQ_EARLY) {                               // dK runs while dQ is stored
            #pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) Wgmma<D, T>::rs(dk, da[kk], cols_desc(q_t, BM, kk));
            wgmma_commit();
            wgmma_wait<1>();
            hold(dq);
        } else {
            wgmma_wait<0>();
            hold(dv); hold(dk); hold(dq);
        }
        if (BWD_DQ_TMA == 2 && !BWD_LEAVE_OUT) {
            // Thread l of warp w4 stores its fragments of column group j at 16 (32 (4 j + w4) + l):
            // row 16 w4 + g (+ 8), columns 8 j + 2 t (+ 1) of this warpgroup's half.
            const int nb = it % BWD_DQ_BUFFERS;
            const uint32_t dqs = sDQ + (nb * WG + wg) * C::DQ_BYTES;
            if (it >= BWD_DQ_BUFFERS) named_sync(DQ_EMPTY + nb * WG + wg, 128 + 32);
            #pragma unroll
            for (int j = 0; j < DH / 8; ++j)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                             :: "r"(dqs + (32 * (4 * j + w4) + lane) * 16),
                                "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3]) : "memory");
            fence_async_smem();
            named_arrive(DQ_FULL + nb * WG + wg, 128 + 32);
        }
        if (BWD_DQ_EARLY) {
            wgmma_wait<0>();
            hold(dv); hold(dk);
        }
        #pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) { hold(pa[kk]); hold(da[kk]); }
        if (lane == 0) mbar_arrive(empty(s));
        // dQ rows m + 16 w4 + g (+ 8), columns c0 + 8 j + 2 t
        if (BWD_DQ_TMA == 2) return;
        if (BWD_DQ_TMA == 1 && !BWD_LEAVE_OUT) {
            // Into this warpgroup's buffer (once the reduce-add that last used it has read it), then
            // one thread hands it to the TMA, which adds it into global memory while the loop goes on.
            const uint32_t dqs = sDQ + ((it % BWD_DQ_BUFFERS) * WG + wg) * C::DQ_BYTES;
            if (tid % 128 == 0) {
                if (BWD_DQ_BUFFERS == 1) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                else asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
            }
            asm volatile("bar.sync %0, 128;\n" :: "r"(2 + wg) : "memory");
            #pragma unroll
            for (int j = 0; j < DH / 8; ++j)
                #pragma unroll
                for (int i = 0; i < 2; ++i)
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                                 :: "r"(dqs + ((16 * w4 + g + 8 * i) * DH + 8 * j + 2 * t) * 4),
                                    "f"(dq[4 * j + 2 * i]), "f"(dq[4 * j + 2 * i + 1]));
            fence_async_smem();
            asm volatile("bar.sync %0, 128;\n" :: "r"(2 + wg) : "memory");
            if (tid % 128 == 0) {
                tma_reduce_add(&p.tm_dq, dqs, c0, m, hq, b);
                asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            }
            return;
        }
        float* row = p.dq + (rows_of(gh) + m + 16 * w4 + g) * D + c0 + 2 * t;
        #pragma unroll
        for (int j = 0; j < (BWD_LEAVE_OUT ? 0 : DH / 8); ++j) {
            atomicAdd(reinterpret_cast<float2*>(row + 8 * j), make_float2(dq[4 * j], dq[4 * j + 1]));
            atomicAdd(reinterpret_cast<float2*>(row + 8 * D + 8 * j), make_float2(dq[4 * j + 2], dq[4 * j + 3]));
        }
    };
    for (; it < n_iters; ++it, next(gh, mi)) {
        if (BWD_PREFETCH && it + 1 < n_iters) step(std::bool_constant<BWD_PREFETCH != 0>{});
        else step(std::false_type{});
    }
    if (BWD_DQ_TMA == 1 && tid % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    // dV and dK (scaled) of keys n0 + krow (+ 8), columns 8 j + 2 t
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int key = n0 + krow + 8 * i;
        if (key >= p.Nk) continue;
        const int64_t at_v = b * p.dv_stride[0] + hkv * p.dv_stride[1] + key * p.dv_stride[2] + 2 * t;
        const int64_t at_k = b * p.dk_stride[0] + hkv * p.dk_stride[1] + key * p.dk_stride[2] + 2 * t;
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            store_pair<T>(p.dv, at_v + 8 * j, dv[4 * j + 2 * i], dv[4 * j + 2 * i + 1]);
            store_pair<T>(p.dk, at_k + 8 * j, dk[4 * j + 2 * i] * p.scale, dk[4 * j + 2 * i + 1] * p.scale);
        }
    }
}

template <typename T, bool CAUSAL>
cudaError_t launch(const Params& p, int batch_heads, cudaStream_t stream) {
    using C = Config<HEAD_DIM, bwdw::CONSUMER_WARPGROUPS, BWD_STAGES>;
    auto kernel = backward_kernel<HEAD_DIM, bwdw::CONSUMER_WARPGROUPS, BWD_STAGES, T, CAUSAL>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    if (err != cudaSuccess) return err;
    dim3 grid((p.Nk + C::BN - 1) / C::BN, batch_heads);
    kernel<<<grid, C::THREADS, C::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}

// dQ from the float32 buffer in fragment order (BWD_DQ_TMA 2) into rows of dq, scaled and cast: a
// block a 64-row tile of one (batch, head).  Its 64 x D floats are read in order (16 bytes a
// thread, a warp's 512 bytes in a row), each float4 being two rows' pair of columns, written into
// a shared tile of rows (padded by 16 bytes, so that a warp's eight rows fall in different banks),
// and the tile leaves in 16-byte pieces of rows.  This is fast_backward_wgmma.py's
// rows_of_fragments, which the CPU tests hold to the writer's order, done in one pass over dQ.
template <int D, typename T>
__global__ void __launch_bounds__(256) rows_kernel(const float* __restrict__ frag, T* dq, int64_t sb, int64_t sh,
                                                   int64_t sn, int heads, int tiles, float scale) {
    constexpr int PITCH = D + 8;                          // elements a shared row
    __shared__ __align__(16) T tile[64 * PITCH];
    const int64_t at = blockIdx.x;                        // ((batch x heads) + head) x tiles + tile
    const float4* src = reinterpret_cast<const float4*>(frag + at * 64 * D);
    #pragma unroll 4
    for (int f = threadIdx.x; f < 16 * D; f += 256) {
        // f = (((w D / 16 + j) 4 + warp) 8 + g) 4 + t; its floats are (i, e) = (0, 0), (0, 1), (1, 0), (1, 1):
        // row 16 warp + 8 i + g, column w D / 2 + 8 j + 2 t + e.
        const float4 x = src[f];
        const int t = f % 4, g = (f / 4) % 8, warp = (f / 32) % 4, wj = f / 128;
        const int row = 16 * warp + g, col = (wj / (D / 16)) * (D / 2) + 8 * (wj % (D / 16)) + 2 * t;
        *reinterpret_cast<uint32_t*>(&tile[row * PITCH + col]) = pack<T>(x.x * scale, x.y * scale);
        *reinterpret_cast<uint32_t*>(&tile[(row + 8) * PITCH + col]) = pack<T>(x.z * scale, x.w * scale);
    }
    __syncthreads();
    const int64_t bh = at / tiles, m = (at % tiles) * 64;
    T* out = dq + (bh / heads) * sb + (bh % heads) * sh + m * sn;
    #pragma unroll 4
    for (int c = threadIdx.x; c < 64 * D / 8; c += 256) {
        const int row = c / (D / 8), piece = c % (D / 8);
        *reinterpret_cast<uint4*>(out + row * sn + 8 * piece) = *reinterpret_cast<const uint4*>(&tile[row * PITCH + 8 * piece]);
    }
}

}  // namespace bwdw

extern "C" {

// HEAD_DIM, keys a block, threads, dynamic shared memory, registers a producer and a consumer
// thread take with setmaxnreg, how dQ is added (BWD_DQ_TMA).
void bwdw_config(int* out) {
    using C = bwdw::Config<HEAD_DIM, bwdw::CONSUMER_WARPGROUPS, BWD_STAGES>;
    out[0] = HEAD_DIM; out[1] = C::BN; out[2] = C::THREADS; out[3] = C::SMEM_BYTES;
    out[4] = C::PRODUCER_REGS; out[5] = C::CONSUMER_REGS; out[6] = BWD_DQ_TMA;
}

// q, do (B, H, Nq, D) and k, v, dk, dv (B, Hkv, Nk, D) through strides: 18 int64 in elements,
// (batch, head, row) for q, k, v, do, dk, dv; the head-dim stride is 1, the others multiples of
// 8, the pointers 16-byte aligned.  lse, delta: (B H, Nq) float32, contiguous, 16-byte aligned.
// dq: (B H, Nq, D) float32, which this zeroes first and which receives dS K unscaled, in rows
// (BWD_DQ_TMA 0, 1) or in fragment order (2: fast_backward_wgmma.py puts it back in rows).
// dtype 0 float16, 1 bfloat16; a window needs causal; order 1 launches causal key blocks longest
// first (dense ones staggered).  Nq and Nk multiples of 128.  Returns 0 or an error code
// (stage4w_error_string).
int bwdw_backward(const void* q, const void* k, const void* v, const void* d_o, const float* lse, const float* delta,
                  float* dq, void* dk, void* dv, const int64_t* st, int batch, int heads, int heads_kv, int n_q,
                  int n_k, int head_dim, float sm_scale, int dtype, int causal, int window, int sink_tokens,
                  int order, void* stream) {
    using C = bwdw::Config<HEAD_DIM, bwdw::CONSUMER_WARPGROUPS, BWD_STAGES>;
    if (head_dim != HEAD_DIM) return -1;
    if (dtype != 0 && dtype != 1) return -2;
    if (heads_kv < 1 || heads % heads_kv) return -5;
    if ((window > 0 && !causal) || window < 0 || sink_tokens < 0) return -6;
    bwdw::Params p;
    const int64_t D = HEAD_DIM;
    int err = stage4w::make_map(&p.tm_q, q, dtype, st[0], st[1], st[2], batch, heads, n_q, HEAD_DIM, C::BM);
    if (!err) err = stage4w::make_map(&p.tm_k, k, dtype, st[3], st[4], st[5], batch, heads_kv, n_k, HEAD_DIM, C::BN);
    if (!err) err = stage4w::make_map(&p.tm_v, v, dtype, st[6], st[7], st[8], batch, heads_kv, n_k, HEAD_DIM, C::BN);
    if (!err) err = stage4w::make_map(&p.tm_do, d_o, dtype, st[9], st[10], st[11], batch, heads, n_q, HEAD_DIM, C::BM);
    if (!err && BWD_DQ_TMA == 1) {
        stage4w::EncodeTiled encode = stage4w::encoder();
        if (!encode) return -3;
        cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)n_q, (cuuint64_t)heads, (cuuint64_t)batch};
        cuuint64_t strides[3] = {(cuuint64_t)D * 4, (cuuint64_t)n_q * D * 4, (cuuint64_t)heads * n_q * D * 4};
        cuuint32_t box[4] = {HEAD_DIM / 2, (cuuint32_t)C::BM, 1, 1}, unit[4] = {1, 1, 1, 1};
        if (encode(&p.tm_dq, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dq, dims, strides, box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            err = -4;
    }
    if (err) return err;
    p.lse = lse; p.delta = delta; p.dq = dq; p.dk = dk; p.dv = dv;
    for (int i = 0; i < 3; ++i) { p.dk_stride[i] = st[12 + i]; p.dv_stride[i] = st[15 + i]; }
    p.H = heads; p.Hkv = heads_kv; p.Nq = n_q; p.Nk = n_k;
    p.window = window; p.sink_tokens = window > 0 ? sink_tokens : 0;   // without a window every key is seen
    p.order = order;
    p.scale = sm_scale; p.scale_log2 = sm_scale * 1.4426950408889634f;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t zeroed = cudaMemsetAsync(dq, 0, (size_t)batch * heads * n_q * D * sizeof(float), s);
    if (zeroed != cudaSuccess) return zeroed;
    const int bkv = batch * heads_kv;                 // a block per (key block, batch, K/V head)
#if BWD_BF16_ONLY
    if (dtype == 0) return -2;
#else
    if (dtype == 0) return causal ? bwdw::launch<__half, true>(p, bkv, s) : bwdw::launch<__half, false>(p, bkv, s);
#endif
    return causal ? bwdw::launch<__nv_bfloat16, true>(p, bkv, s) : bwdw::launch<__nv_bfloat16, false>(p, bkv, s);
}

// dq (B, H, N, D) of dtype (0 float16, 1 bfloat16) through its (batch, head, row) strides in st
// (elements; the head-dim stride 1, the others multiples of 8, dq 16-byte aligned) from bwdw_backward's
// float32 dQ in fragment order (BWD_DQ_TMA 2), times sm_scale.  N a multiple of 64.
int bwdw_rows(const float* frag, void* dq, const int64_t* st, int batch, int heads, int n, float sm_scale, int dtype,
              void* stream) {
    if (BWD_DQ_TMA != 2) return -7;
    if (dtype != 0 && dtype != 1) return -2;
    if (n % 64 || (st[0] | st[1] | st[2]) % 8 || reinterpret_cast<uintptr_t>(dq) % 16) return -8;
    const int tiles = n / 64;
    const int64_t blocks = (int64_t)batch * heads * tiles;
    if (blocks == 0) return 0;
    if (blocks > 2147483647) return -9;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dtype == 0) {
#if BWD_BF16_ONLY
        return -2;
#else
        bwdw::rows_kernel<HEAD_DIM, __half><<<(unsigned)blocks, 256, 0, s>>>(frag, static_cast<__half*>(dq), st[0], st[1],
                                                                             st[2], heads, tiles, sm_scale);
#endif
    } else {
        bwdw::rows_kernel<HEAD_DIM, __nv_bfloat16><<<(unsigned)blocks, 256, 0, s>>>(
            frag, static_cast<__nv_bfloat16*>(dq), st[0], st[1], st[2], heads, tiles, sm_scale);
    }
    return cudaGetLastError();
}

}  // extern "C"
