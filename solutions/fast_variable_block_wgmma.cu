// A faster stage 4 for Hopper (sm_90a): the same FlashAttention forward as
// stage4_variable_block.cu, rebuilt around the warpgroup matrix multiply (wgmma) and the
// tensor memory accelerator (TMA).  The instructors' fast variant, beside the learner's kernel;
// solutions/fast_variable_block_wgmma.py says which is which and drives it.  It also takes the
// masks of stages 5-8: GQA (a query head reads K/V head h / group), a causal sliding window that
// keeps the first sink_tokens keys (the key blocks a row block visits: the sink tokens' blocks,
// then the window's), and learned sinks (one more term in each row's denominator, at the end).
//
// One thread block: a producer warpgroup and WARPGROUPS consumer warpgroups of 64 query rows.
//
//   producer (one thread)                       consumer warpgroup w (rows 64 w .. 64 w + 63)
//   Q tile -> bar_q                             wait bar_q; block 0: S, softmax -> P_0
//   for each key block j, stage s = j % STAGES: for each key block j >= 1:
//     wait empty_k[s]; K_j -> full_k[s]           wait full_k[s]; [wait for its turn]
//     wait empty_v[s]; V_j -> full_v[s]           issue S = Q K_j^T; wait full_v[s-1];
//                                                 issue O += P_{j-1} V_{j-1}; [pass the turn on]
//                                                 wait for S; arrive empty_k[s]; softmax -> P_j
//                                                 wait for P V; arrive empty_v[s-1]; rescale O
//                                               O += P_last V_last; O / l -> TMA store
//
// The turns (PINGPONG=1, FlashAttention-3's "ping-pong") are named barriers that make the
// consumer warpgroups issue their products one after the other, so that one warpgroup's softmax
// runs while the tensor cores work through another's products.
//
// The loop body has no branch between issuing a product and waiting for it: ptxas serializes
// every wgmma of a kernel (warning C7514) when it cannot prove that no other instruction touches
// an accumulator in flight, and a branch that merges the accumulator's values is such a touch.
// So block 0 is peeled off the loop.  Tiles whose registers do not fit serialize too (C7512).
//
// Shared memory: every tile is a set of 64-column panels with 128-byte rows, as the TMA writes
// them with its 128-byte swizzle (16-byte chunk c of row r lands at chunk c ^ (r % 8)).  A
// wgmma descriptor names such a tile by its start address, SBO = 1024 bytes between 8-row
// groups, and for V (read transposed, the head dim along N) LBO = the distance between panels.
// A head dim that is not a multiple of 64 leaves the last panel part empty: the TMA fills those
// columns with zeros, so Q K^T can run over them in steps of 16 while P V stops at HEAD_DIM.
//
// docs/stage4-notes.md says why the kernel is built this way (and not with cp.async from every
// thread); docs/hopper-notes.md has what the turns and the straight loop measured, and
// docs/performance.md its speed beside SDPA's backends.

#include <cuda.h>                 // CUtensorMap and its enums (the encoder comes from the runtime, no -lcuda)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 96
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef WARPGROUPS
#define WARPGROUPS 2
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif
#ifndef STAGE4W_NO_FORWARD        // 1: the helpers alone, no forward kernel (fast_backward_wgmma.cu includes them)
#define STAGE4W_NO_FORWARD 0
#endif
#ifndef ONLY_MASK                 // -1: every mask's kernels; 0 (none), 1 (causal) or 2 (a window): that one
#define ONLY_MASK -1              // alone, for compile tests that ask ptxas about one mask's kernels
#endif
#ifndef EARLY_RESCALE             // 1: rescale O while S runs, before P V is issued (measured, not planned)
#define EARLY_RESCALE 0
#endif

namespace stage4w {

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

template <int D, int BN, int WG, int NS>
struct Config {
    static_assert(D % 8 == 0 && D >= 16 && D <= 256, "HEAD_DIM must be a multiple of 8 from 16 to 256");
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "BLOCK_N must be a multiple of 16 up to 256");
    static_assert(WG >= 1 && WG <= 3, "WARPGROUPS must be 1, 2 or 3");
    static_assert(NS >= 2 && NS <= 4, "STAGES must be 2, 3 or 4");
    static constexpr int DP = round_up(D, 16);          // Q K^T reduces in steps of 16
    static constexpr int PANELS = (D + 63) / 64;        // 64-column panels of 128-byte rows
    static constexpr int BM = 64 * WG;
    static constexpr int CONSUMERS = 128 * WG;          // the warpgroups that compute
    static constexpr int THREADS = CONSUMERS + 128;     // + a producer warpgroup (one thread issues the loads)
    // setmaxnreg moves registers from the producer to the consumers, within what the block was
    // launched with: the most a thread may have under __launch_bounds__ (at most 255, in steps of
    // 8) times the threads.  A consumer that asks for more than is left waits for ever.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int LAUNCH_REGS = (65536 / THREADS < 255 ? 65536 / THREADS : 255) / 8 * 8;
    static constexpr int CONSUMER_REGS_FIT = (LAUNCH_REGS * THREADS - 128 * PRODUCER_REGS) / CONSUMERS / 8 * 8;
    static constexpr int CONSUMER_REGS = CONSUMER_REGS_FIT > 256 ? 256 : CONSUMER_REGS_FIT;
    static_assert(128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= LAUNCH_REGS * THREADS,
                  "setmaxnreg would ask for more registers than the block has");
    static constexpr int Q_BYTES = PANELS * BM * 128;
    static constexpr int KV_BYTES = PANELS * BN * 128;  // one K or V tile
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * NS * KV_BYTES + 1024;   // + alignment slack
};

struct Params {
    CUtensorMap tm_q, tm_k, tm_v, tm_o;   // (D, N, H, B) views, boxes of 64 columns, 128-byte swizzle
    float* lse;
    const float* sinks;                   // learned sinks, one logit a query head, or null
    int H, group, Nq, Nk;                 // query heads; query heads a K/V head (GQA)
    int window, sink_tokens;              // a causal window of `window` keys (0: none) and the sink tokens it keeps
    float scale_log2;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers and TMA ----------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int col, int row, int h, int b, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(map), "r"(col), "r"(row), "r"(h), "r"(b), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int col, int row, int h, int b) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(map), "r"(src), "r"(col), "r"(row), "r"(h), "r"(b) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Matrix descriptor for a 128-byte-swizzled tile: start address, LBO and SBO in units of 16
// bytes, layout type 1 (128-byte swizzle) in bits 62-63.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

// ---- wgmma wrappers --------------------------------------------------------------------
// m64nNk16 with float32 accumulators: each thread holds N / 2 of them, in the mma.sync layout
// per warp (warp w of the warpgroup owns rows 16 w .. 16 w + 15): d[4 j + 0, 1] row g, columns
// 8 j + 2 t, + 1; d[4 j + 2, 3] row g + 8; g = lane / 4, t = lane % 4.
// Inline asm numbers its operands outputs first, so the inputs are passed as read-write
// operands ahead of the accumulators to keep their numbers fixed: %0..%2 for ss (descriptor A,
// descriptor B, accumulate flag), %0..%5 for rs (descriptor B, flag, four A registers).  The
// tables below list the accumulator operands for N / 8 groups of four.
#define WG_SS_1  "%3, %4, %5, %6"
#define WG_SS_2  WG_SS_1 ", " "%7, %8, %9, %10"
#define WG_SS_3  WG_SS_2 ", " "%11, %12, %13, %14"
#define WG_SS_4  WG_SS_3 ", " "%15, %16, %17, %18"
#define WG_SS_5  WG_SS_4 ", " "%19, %20, %21, %22"
#define WG_SS_6  WG_SS_5 ", " "%23, %24, %25, %26"
#define WG_SS_7  WG_SS_6 ", " "%27, %28, %29, %30"
#define WG_SS_8  WG_SS_7 ", " "%31, %32, %33, %34"
#define WG_SS_9  WG_SS_8 ", " "%35, %36, %37, %38"
#define WG_SS_10 WG_SS_9 ", " "%39, %40, %41, %42"
#define WG_SS_11 WG_SS_10 ", " "%43, %44, %45, %46"
#define WG_SS_12 WG_SS_11 ", " "%47, %48, %49, %50"
#define WG_SS_13 WG_SS_12 ", " "%51, %52, %53, %54"
#define WG_SS_14 WG_SS_13 ", " "%55, %56, %57, %58"
#define WG_SS_15 WG_SS_14 ", " "%59, %60, %61, %62"
#define WG_SS_16 WG_SS_15 ", " "%63, %64, %65, %66"
#define WG_SS_17 WG_SS_16 ", " "%67, %68, %69, %70"
#define WG_SS_18 WG_SS_17 ", " "%71, %72, %73, %74"
#define WG_SS_19 WG_SS_18 ", " "%75, %76, %77, %78"
#define WG_SS_20 WG_SS_19 ", " "%79, %80, %81, %82"
#define WG_SS_21 WG_SS_20 ", " "%83, %84, %85, %86"
#define WG_SS_22 WG_SS_21 ", " "%87, %88, %89, %90"
#define WG_SS_23 WG_SS_22 ", " "%91, %92, %93, %94"
#define WG_SS_24 WG_SS_23 ", " "%95, %96, %97, %98"
#define WG_SS_25 WG_SS_24 ", " "%99, %100, %101, %102"
#define WG_SS_26 WG_SS_25 ", " "%103, %104, %105, %106"
#define WG_SS_27 WG_SS_26 ", " "%107, %108, %109, %110"
#define WG_SS_28 WG_SS_27 ", " "%111, %112, %113, %114"
#define WG_SS_29 WG_SS_28 ", " "%115, %116, %117, %118"
#define WG_SS_30 WG_SS_29 ", " "%119, %120, %121, %122"
#define WG_SS_31 WG_SS_30 ", " "%123, %124, %125, %126"
#define WG_SS_32 WG_SS_31 ", " "%127, %128, %129, %130"
#define WG_RS_1  "%6, %7, %8, %9"
#define WG_RS_2  WG_RS_1 ", " "%10, %11, %12, %13"
#define WG_RS_3  WG_RS_2 ", " "%14, %15, %16, %17"
#define WG_RS_4  WG_RS_3 ", " "%18, %19, %20, %21"
#define WG_RS_5  WG_RS_4 ", " "%22, %23, %24, %25"
#define WG_RS_6  WG_RS_5 ", " "%26, %27, %28, %29"
#define WG_RS_7  WG_RS_6 ", " "%30, %31, %32, %33"
#define WG_RS_8  WG_RS_7 ", " "%34, %35, %36, %37"
#define WG_RS_9  WG_RS_8 ", " "%38, %39, %40, %41"
#define WG_RS_10 WG_RS_9 ", " "%42, %43, %44, %45"
#define WG_RS_11 WG_RS_10 ", " "%46, %47, %48, %49"
#define WG_RS_12 WG_RS_11 ", " "%50, %51, %52, %53"
#define WG_RS_13 WG_RS_12 ", " "%54, %55, %56, %57"
#define WG_RS_14 WG_RS_13 ", " "%58, %59, %60, %61"
#define WG_RS_15 WG_RS_14 ", " "%62, %63, %64, %65"
#define WG_RS_16 WG_RS_15 ", " "%66, %67, %68, %69"
#define WG_RS_17 WG_RS_16 ", " "%70, %71, %72, %73"
#define WG_RS_18 WG_RS_17 ", " "%74, %75, %76, %77"
#define WG_RS_19 WG_RS_18 ", " "%78, %79, %80, %81"
#define WG_RS_20 WG_RS_19 ", " "%82, %83, %84, %85"
#define WG_RS_21 WG_RS_20 ", " "%86, %87, %88, %89"
#define WG_RS_22 WG_RS_21 ", " "%90, %91, %92, %93"
#define WG_RS_23 WG_RS_22 ", " "%94, %95, %96, %97"
#define WG_RS_24 WG_RS_23 ", " "%98, %99, %100, %101"
#define WG_RS_25 WG_RS_24 ", " "%102, %103, %104, %105"
#define WG_RS_26 WG_RS_25 ", " "%106, %107, %108, %109"
#define WG_RS_27 WG_RS_26 ", " "%110, %111, %112, %113"
#define WG_RS_28 WG_RS_27 ", " "%114, %115, %116, %117"
#define WG_RS_29 WG_RS_28 ", " "%118, %119, %120, %121"
#define WG_RS_30 WG_RS_29 ", " "%122, %123, %124, %125"
#define WG_RS_31 WG_RS_30 ", " "%126, %127, %128, %129"
#define WG_RS_32 WG_RS_31 ", " "%130, %131, %132, %133"
#define WG_D_1  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define WG_D_2  WG_D_1, "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define WG_D_3  WG_D_2, "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define WG_D_4  WG_D_3, "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WG_D_5  WG_D_4, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define WG_D_6  WG_D_5, "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define WG_D_7  WG_D_6, "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
#define WG_D_8  WG_D_7, "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D_9  WG_D_8, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define WG_D_10 WG_D_9, "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define WG_D_11 WG_D_10, "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43])
#define WG_D_12 WG_D_11, "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define WG_D_13 WG_D_12, "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
#define WG_D_14 WG_D_13, "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
#define WG_D_15 WG_D_14, "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
#define WG_D_16 WG_D_15, "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_D_17 WG_D_16, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
#define WG_D_18 WG_D_17, "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
#define WG_D_19 WG_D_18, "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75])
#define WG_D_20 WG_D_19, "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define WG_D_21 WG_D_20, "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83])
#define WG_D_22 WG_D_21, "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define WG_D_23 WG_D_22, "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91])
#define WG_D_24 WG_D_23, "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define WG_D_25 WG_D_24, "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
#define WG_D_26 WG_D_25, "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
#define WG_D_27 WG_D_26, "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107])
#define WG_D_28 WG_D_27, "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
#define WG_D_29 WG_D_28, "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115])
#define WG_D_30 WG_D_29, "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
#define WG_D_31 WG_D_30, "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123])
#define WG_D_32 WG_D_31, "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>                            // wait until at most PENDING committed batches still run
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(PENDING) : "memory"); }
// Keeps the compiler from touching registers that an issued wgmma still reads or writes.
template <int N> __device__ __forceinline__ void hold(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int N> __device__ __forceinline__ void hold(uint32_t (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i]) :: "memory");
}

template <int N, typename T> struct Wgmma;
#define STAGE4W_WGMMA(N, G, T, TY)                                                                      \
    template <> struct Wgmma<N, T> {                                                                    \
        /* d (+)= A B, A and B from shared memory; accumulate = 0 overwrites d */                       \
        __device__ __forceinline__ static void ss(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n"                                    \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                 \
                         "{" WG_SS_##G "}, %0, %1, p, 1, 1, 0, 0;\n}\n"                                  \
                         : "+l"(da), "+l"(db), "+r"(acc), WG_D_##G);                                     \
        }                                                                                               \
        /* d += A B, A from registers (the mma.sync A fragment), B transposed from shared memory */     \
        __device__ __forceinline__ static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db) { \
            uint32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], acc = 1;                                \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"                                    \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                 \
                         "{" WG_RS_##G "}, {%2, %3, %4, %5}, %0, p, 1, 1, 1;\n}\n"                       \
                         : "+l"(db), "+r"(acc), "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3), WG_D_##G);       \
        }                                                                                               \
    };
#define STAGE4W_BOTH(N, G) STAGE4W_WGMMA(N, G, __half, "f16") STAGE4W_WGMMA(N, G, __nv_bfloat16, "bf16")
STAGE4W_BOTH(8, 1)    STAGE4W_BOTH(16, 2)   STAGE4W_BOTH(24, 3)   STAGE4W_BOTH(32, 4)
STAGE4W_BOTH(40, 5)   STAGE4W_BOTH(48, 6)   STAGE4W_BOTH(56, 7)   STAGE4W_BOTH(64, 8)
STAGE4W_BOTH(72, 9)   STAGE4W_BOTH(80, 10)  STAGE4W_BOTH(88, 11)  STAGE4W_BOTH(96, 12)
STAGE4W_BOTH(104, 13) STAGE4W_BOTH(112, 14) STAGE4W_BOTH(120, 15) STAGE4W_BOTH(128, 16)
STAGE4W_BOTH(136, 17) STAGE4W_BOTH(144, 18) STAGE4W_BOTH(152, 19) STAGE4W_BOTH(160, 20)
STAGE4W_BOTH(168, 21) STAGE4W_BOTH(176, 22) STAGE4W_BOTH(184, 23) STAGE4W_BOTH(192, 24)
STAGE4W_BOTH(200, 25) STAGE4W_BOTH(208, 26) STAGE4W_BOTH(216, 27) STAGE4W_BOTH(224, 28)
STAGE4W_BOTH(232, 29) STAGE4W_BOTH(240, 30) STAGE4W_BOTH(248, 31) STAGE4W_BOTH(256, 32)

template <typename T> __device__ __forceinline__ uint32_t pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <int D, int BN, int WG, int NS, typename T, bool CAUSAL, bool WINDOW>
__global__ void __launch_bounds__(Config<D, BN, WG, NS>::THREADS, 1)
attention_kernel(const __grid_constant__ Params p) {
    using C = Config<D, BN, WG, NS>;
    constexpr int BM = C::BM, PANELS = C::PANELS;
    constexpr int K_STEPS = C::DP / 16;           // wgmmas of Q K^T (k = 16 along the head dim)
    constexpr int P_STEPS = BN / 16;              // wgmmas of P V (k = 16 along the keys)

    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[1 + 4 * NS];
    const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;   // swizzled tiles start on 1024 bytes
    const uint32_t sQ = base;                                     // [PANELS][BM rows][128 bytes]
    const uint32_t sK = sQ + C::Q_BYTES;                          // [NS][PANELS][BN rows][128 bytes]
    const uint32_t sV = sK + NS * C::KV_BYTES;
    const uint32_t bar_q = smem_addr(&bars[0]);
    auto full_k = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty_k = [&](int s) { return smem_addr(&bars[1 + NS + s]); };
    auto full_v = [&](int s) { return smem_addr(&bars[1 + 2 * NS + s]); };
    auto empty_v = [&](int s) { return smem_addr(&bars[1 + 3 * NS + s]); };

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int m0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H, h_kv = h / p.group;
    const int offset = p.Nk - p.Nq;
    const int n_end = CAUSAL ? min(p.Nk, m0 + BM + offset) : p.Nk;
    // The key blocks these rows visit, in order: the sink tokens' blocks below the window, then
    // the window's first block to the last block with a visible key.  block_at(i) is the i-th.
    const int lo_blk = WINDOW ? max(0, m0 + offset - p.window + 1) / BN : 0;
    const int end_blk = n_end > 0 ? (n_end + BN - 1) / BN : 0;
    const int sink_blks = WINDOW ? min((p.sink_tokens + BN - 1) / BN, lo_blk) : 0;
    const int n_blocks = end_blk > lo_blk ? sink_blks + end_blk - lo_blk : 0;
    auto block_at = [&](int i) { return i < sink_blks ? i : lo_blk + i - sink_blks; };
    const int past = WINDOW ? offset - p.window + 1 : 0;   // a key col is before row's window if col < row + past

    if (tid == 0) {
        mbar_init(bar_q, 1);
        for (int s = 0; s < NS; ++s) {
            mbar_init(full_k(s), 1); mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), C::CONSUMERS / 32); mbar_init(empty_v(s), C::CONSUMERS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // ---- the producer warpgroup: Q once, then K and V tiles into a ring of NS stages ------
    if (warp < 4) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(C::PRODUCER_REGS));
        if (warp == 0 && lane == 0) {
            mbar_expect_tx(bar_q, C::Q_BYTES);
            for (int c = 0; c < PANELS; ++c) tma_load(sQ + c * BM * 128, &p.tm_q, 64 * c, m0, h, b, bar_q);
            for (int nb = 0; nb < n_blocks; ++nb) {
                const int s = nb % NS;
                const uint32_t free_parity = ((nb / NS) & 1) ^ 1;    // the first pass finds every stage free
                mbar_wait(empty_k(s), free_parity);
                mbar_expect_tx(full_k(s), C::KV_BYTES);
                for (int c = 0; c < PANELS; ++c)
                    tma_load(sK + s * C::KV_BYTES + c * BN * 128, &p.tm_k, 64 * c, block_at(nb) * BN, h_kv, b, full_k(s));
                mbar_wait(empty_v(s), free_parity);
                mbar_expect_tx(full_v(s), C::KV_BYTES);
                for (int c = 0; c < PANELS; ++c)
                    tma_load(sV + s * C::KV_BYTES + c * BN * 128, &p.tm_v, 64 * c, block_at(nb) * BN, h_kv, b, full_v(s));
            }
        }
        return;
    }

    // ---- the consumer warpgroups ---------------------------------------------------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(C::CONSUMER_REGS));
    const int wg = warp / 4 - 1, g = lane / 4, t = lane % 4;
    const int row_w = wg * 64 + (warp % 4) * 16;  // this warp's first row in the block
    const int r0 = m0 + row_w;
    float acc[D / 2];
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
    #pragma unroll
    for (int j = 0; j < D / 2; ++j) acc[j] = 0.f;
    uint32_t pa[P_STEPS][4];                      // P of the previous block, the A operand of P V

    // Q K^T step kk reads 16 columns: panel kk / 4, 32 bytes in per step; rows of 128 bytes,
    // 8-row groups 1024 bytes apart (SBO).  P V step kk reads 16 keys: two 8-row groups of every
    // panel; the panels (64 output columns each) are LBO = BN * 128 bytes apart.
    auto q_desc = [&](int kk) { return descriptor(sQ + (kk / 4) * BM * 128 + wg * 64 * 128 + (kk % 4) * 32, 16, 1024); };
    auto k_desc = [&](uint32_t kt, int kk) { return descriptor(kt + (kk / 4) * BN * 128 + (kk % 4) * 32, 16, 1024); };
    auto v_desc = [&](uint32_t vt, int kk) { return descriptor(vt + kk * 2048, BN * 128, 1024); };

    // Ping-pong: consumer warpgroups take turns issuing their products (named barriers 4 + wg,
    // 256 threads: this warpgroup's sync and the previous one's arrive); the first goes first.
    constexpr bool PP = PINGPONG && WG > 1;
    auto turn_wait = [&]() { if (PP) asm volatile("bar.sync %0, 256;\n" :: "r"(4 + wg) : "memory"); };
    auto turn_pass = [&]() { if (PP) asm volatile("bar.arrive %0, 256;\n" :: "r"(4 + (wg + 1) % WG) : "memory"); };
    if (PP && wg == 0) asm volatile("bar.arrive %0, 256;\n" :: "r"(4) : "memory");

    float alpha[2] = {1.f, 1.f};
    auto issue_s = [&](float (&sc)[BN / 2], int s) {
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk)      // S = Q K^T over the head dim; the first one overwrites sc
            Wgmma<BN, T>::ss(sc, q_desc(kk), k_desc(sK + s * C::KV_BYTES, kk), kk > 0);
        wgmma_commit();
    };
    auto rescale = [&]() {
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            acc[4 * j] *= alpha[0]; acc[4 * j + 1] *= alpha[0];
            acc[4 * j + 2] *= alpha[1]; acc[4 * j + 3] *= alpha[1];
        }
    };
    auto issue_pv = [&](int s) {
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < P_STEPS; ++kk) Wgmma<D, T>::rs(acc, pa[kk], v_desc(sV + s * C::KV_BYTES, kk));
        wgmma_commit();
    };
    // Online softmax of the block starting at key n0, rows r0 + g (sc[4j + 0, 1]) and r0 + g + 8
    // (sc[4j + 2, 3]): turns the scores into P in place and leaves O's rescale factor in alpha.
    auto softmax = [&](float (&sc)[BN / 2], int n0) {
        const bool need_mask = n0 + BN > p.Nk || (CAUSAL && n0 + BN - 1 > m0 + offset) ||
                               (WINDOW && n0 < m0 + BM - 1 + past && n0 + BN > p.sink_tokens);
        if (need_mask) {
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n0 + 8 * j + 2 * t + (e & 1), row = r0 + g + (e >> 1) * 8;
                    if (col >= p.Nk || (CAUSAL && col > row + offset) || (WINDOW && col < row + past && col >= p.sink_tokens))
                        sc[4 * j + e] = -INFINITY;
                }
        }
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = m_i[i];
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * i], sc[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
            alpha[i] = fast_exp2(m_i[i] * p.scale_log2 - m_scaled);
            float sum = 0.f;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                sc[4 * j + 2 * i] = fast_exp2(fmaf(sc[4 * j + 2 * i], p.scale_log2, -m_scaled));
                sc[4 * j + 2 * i + 1] = fast_exp2(fmaf(sc[4 * j + 2 * i + 1], p.scale_log2, -m_scaled));
                sum += sc[4 * j + 2 * i] + sc[4 * j + 2 * i + 1];
            }
            l_i[i] = l_i[i] * alpha[i] + sum;
            m_i[i] = mx;
        }
    };
    auto to_pa = [&](const float (&sc)[BN / 2]) {
        #pragma unroll
        for (int kk = 0; kk < P_STEPS; ++kk) {
            pa[kk][0] = pack<T>(sc[8 * kk + 0], sc[8 * kk + 1]);
            pa[kk][1] = pack<T>(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack<T>(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack<T>(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
    };

    mbar_wait(bar_q, 0);
    if (n_blocks > 0) {
        {                                         // block 0: S only
            float sc[BN / 2];
            mbar_wait(full_k(0), 0);
            turn_wait();
            issue_s(sc, 0);
            turn_pass();
            wgmma_wait<0>();
            hold(sc);
            if (lane == 0) mbar_arrive(empty_k(0));
            softmax(sc, block_at(0) * BN);
            to_pa(sc);
        }
        // Straight-line body (no branch while a product runs, or ptxas serializes every wgmma):
        // S of block nb and P V of block nb - 1 are issued together, the softmax of nb runs
        // while P V does.
        for (int nb = 1; nb < n_blocks; ++nb) {
            const int s = nb % NS, ps = (nb + NS - 1) % NS;
            float sc[BN / 2];
            mbar_wait(full_k(s), (nb / NS) & 1);
            turn_wait();
            issue_s(sc, s);
            if (EARLY_RESCALE) rescale();
            mbar_wait(full_v(ps), ((nb - 1) / NS) & 1);
            issue_pv(ps);
            turn_pass();
            wgmma_wait<1>();                      // S is done; P V may still run
            hold(sc);
            if (lane == 0) mbar_arrive(empty_k(s));
            softmax(sc, block_at(nb) * BN);
            wgmma_wait<0>();                      // P V has finished with acc, pa and V tile ps
            hold(acc);
            #pragma unroll
            for (int kk = 0; kk < P_STEPS; ++kk) hold(pa[kk]);
            if (lane == 0) mbar_arrive(empty_v(ps));
            if (!EARLY_RESCALE) rescale();
            to_pa(sc);
        }
        const int ls = (n_blocks - 1) % NS;       // P V of the last block
        mbar_wait(full_v(ls), ((n_blocks - 1) / NS) & 1);
        if (EARLY_RESCALE) rescale();
        issue_pv(ls);
        wgmma_wait<0>();
        hold(acc);
        #pragma unroll
        for (int kk = 0; kk < P_STEPS; ++kk) hold(pa[kk]);
    }
    // Epilogue: O = acc / l into this warpgroup's rows of the Q tile, in the same swizzled
    // layout (16-byte chunk c of row r sits at chunk c ^ (r % 8)), then one TMA store per panel;
    // the TMA drops rows past Nq.  lse = (m * scale_log2 + log2 l) * ln 2, or -inf for no key.
    // A learned sink s adds exp(s) to the denominator: in log2 units against M = max(m2, s2),
    // l 2^(m2 - M) + 2^(s2 - M), which is 1 for a row that saw no key (o = 0, lse = s).
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        float l = l_i[i];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const float m2 = l > 0.f ? m_i[i] * p.scale_log2 : -INFINITY;
        float inv = l > 0.f ? 1.f / l : 0.f, lse2 = l > 0.f ? m2 + __log2f(l) : -INFINITY;
        if (p.sinks != nullptr) {
            const float s2 = p.sinks[h] * 1.4426950408889634f, top = fmaxf(m2, s2);
            if (top != -INFINITY) {               // a sink of -inf on a row with no key: o = 0, lse = -inf
                const float total = l * fast_exp2(m2 - top) + fast_exp2(s2 - top);
                inv = fast_exp2(m2 - top) / total;
                lse2 = top + __log2f(total);
            }
        }
        const int r = row_w + g + 8 * i;          // row in the block; r % 8 == g
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const uint32_t a = sQ + (j / 8) * BM * 128 + r * 128 + (((j % 8) ^ g) * 16) + 4 * t;
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(a), "r"(pack<T>(acc[4 * j + 2 * i] * inv, acc[4 * j + 2 * i + 1] * inv)));
        }
        const int row = m0 + r;
        if (t == 0 && row < p.Nq)
            p.lse[(int64_t)bh * p.Nq + row] = lse2 * 0.69314718055994531f;
    }
    fence_async_smem();                           // these writes, then the TMA's reads
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory");   // this warpgroup only
    if (tid % 128 == 0) {
        for (int c = 0; c < PANELS; ++c) tma_store(&p.tm_o, sQ + c * BM * 128 + wg * 64 * 128, 64 * c, m0 + wg * 64, h, b);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}

// ---- host side ---------------------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiled encoder() {
    static EncodeTiled fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult found;
        void* f = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) == cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<EncodeTiled>(f);
    }
    return fn;
}

// A (B, H, N, D) tensor with unit head-dim stride as a 4-D map (D, N, H, B); box 64 x rows.
static int make_map(CUtensorMap* map, const void* ptr, int dtype, int64_t sb, int64_t sh, int64_t sn,
                    int B, int H, int N, int D, int rows) {
    EncodeTiled encode = encoder();
    if (!encode) return -3;
    cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)N, (cuuint64_t)H, (cuuint64_t)B};
    cuuint64_t strides[3] = {(cuuint64_t)sn * 2, (cuuint64_t)sh * 2, (cuuint64_t)sb * 2};
    cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1};
    cuuint32_t unit[4] = {1, 1, 1, 1};
    CUresult r = encode(map, dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                        const_cast<void*>(ptr), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -4;
}

template <typename T, bool CAUSAL, bool WINDOW>
cudaError_t launch(const Params& p, int batch_heads, cudaStream_t stream) {
    using C = Config<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
    auto kernel = attention_kernel<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, T, CAUSAL, WINDOW>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    if (err != cudaSuccess) return err;
    dim3 grid((p.Nq + C::BM - 1) / C::BM, batch_heads);
    kernel<<<grid, C::THREADS, C::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace stage4w

extern "C" {

// HEAD_DIM, BLOCK_M, BLOCK_N, WARPGROUPS, threads per block, dynamic shared memory and PINGPONG of this build.
void stage4w_config(int* out) {
    using C = stage4w::Config<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
    out[0] = HEAD_DIM; out[1] = C::BM; out[2] = BLOCK_N; out[3] = WARPGROUPS; out[4] = C::THREADS;
    out[5] = C::SMEM_BYTES; out[6] = PINGPONG;
}

const char* stage4w_error_string(int code) {
    if (code == -1) return "the head dim does not match the head dim this kernel was compiled for";
    if (code == -2) return "unsupported dtype code (0: float16, 1: bfloat16)";
    if (code == -3) return "cuTensorMapEncodeTiled is not available from this driver";
    if (code == -4) return "cuTensorMapEncodeTiled rejected a tensor (strides must be multiples of 16 bytes)";
    if (code == -5) return "heads must be a positive multiple of kv_heads";
    if (code == -6) return "a window needs the causal mask, and window and sink_tokens must be >= 0";
    if (code == -10) return "this build holds one mask's kernels only (ONLY_MASK), not this call's";
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// strides: 12 int64 in elements, (batch, head, row) for q, k, v, o; the head-dim stride is 1,
// the others multiples of 8, the pointers 16-byte aligned.  dtype: 0 float16, 1 bfloat16.
// kv_heads: K/V heads (heads / kv_heads query heads share one); window: a causal sliding window
// of that many keys (0: none), which keeps the first sink_tokens keys; sinks: one float32 logit
// a query head, or null.
#if !STAGE4W_NO_FORWARD
int stage4w_forward(const void* q, const void* k, const void* v, void* o, float* lse, const int64_t* st,
                    int batch, int heads, int kv_heads, int n_q, int n_k, int head_dim, float sm_scale, int dtype,
                    int causal, int window, int sink_tokens, const float* sinks, void* stream) {
    using C = stage4w::Config<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
    if (head_dim != HEAD_DIM) return -1;
    if (dtype != 0 && dtype != 1) return -2;
    if (kv_heads < 1 || heads % kv_heads) return -5;
    if (window < 0 || sink_tokens < 0 || (window > 0 && !causal)) return -6;
    stage4w::Params p;
    int err = stage4w::make_map(&p.tm_q, q, dtype, st[0], st[1], st[2], batch, heads, n_q, HEAD_DIM, C::BM);
    if (!err) err = stage4w::make_map(&p.tm_k, k, dtype, st[3], st[4], st[5], batch, kv_heads, n_k, HEAD_DIM, BLOCK_N);
    if (!err) err = stage4w::make_map(&p.tm_v, v, dtype, st[6], st[7], st[8], batch, kv_heads, n_k, HEAD_DIM, BLOCK_N);
    if (!err) err = stage4w::make_map(&p.tm_o, o, dtype, st[9], st[10], st[11], batch, heads, n_q, HEAD_DIM, 64);
    if (err) return err;
    p.lse = lse;
    p.sinks = sinks;
    p.H = heads; p.group = heads / kv_heads; p.Nq = n_q; p.Nk = n_k;
    p.window = window; p.sink_tokens = window > 0 ? sink_tokens : 0;   // without a window every key is seen
    p.scale_log2 = sm_scale * 1.4426950408889634f;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int bh = batch * heads;
    const int mask = window > 0 ? 2 : causal ? 1 : 0;
#define STAGE4W_MASK(m, causal_, window_)                                                      \
    if (mask == m) return dtype == 0 ? stage4w::launch<__half, causal_, window_>(p, bh, s)      \
                                     : stage4w::launch<__nv_bfloat16, causal_, window_>(p, bh, s);
#if ONLY_MASK < 0 || ONLY_MASK == 2
    STAGE4W_MASK(2, true, true)
#endif
#if ONLY_MASK < 0 || ONLY_MASK == 1
    STAGE4W_MASK(1, true, false)
#endif
#if ONLY_MASK < 0 || ONLY_MASK == 0
    STAGE4W_MASK(0, false, false)
#endif
#undef STAGE4W_MASK
    return -10;                                       // a mask this build leaves out (ONLY_MASK)
}
#endif  // !STAGE4W_NO_FORWARD

}  // extern "C"
