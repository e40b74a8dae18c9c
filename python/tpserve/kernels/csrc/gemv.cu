// Small-M GEMV for decode: y[M, N] = x[M, K] @ W[N, K]^T for M = 1..8 tokens, x and y bf16
// (row-major, contiguous), float32 accumulation. W is bf16, or float8_e4m3fn with one float32
// scale per 128x128 block (scale_inv [ceil(N/128), ceil(K/128)], W_real = W * scale_inv: the
// DeepSeek / Qwen3-FP8 layout), or (kRowScale, one token) one scale per row (compressed-tensors' per-channel and
// per-tensor checkpoints, held as [N, 1]; a MoE layer's experts as [E, rows, 1]), applied once to the row's float32
// sum. Built and called by tpserve.kernels.gemv.
//
// At a few tokens the product is bound by reading W, so everything serves W's stream:
// * a block of kThreads threads owns R rows of W (R by M: x loads are shared by the R rows, so
//   the L1 traffic of x stays within ~4x that of W at M = 8) and splits K between its threads:
//   thread t reads the 16-byte chunks t, t + kThreads, ... of each row, so each warp reads 512
//   contiguous bytes per load and even N = 2048 fills the GPU with blocks;
// * a thread issues kLoadsInFlight 16-byte loads of W (bypassing L1, which keeps x) before it
//   uses any of them; x is read through L1 by coherent loads (load_input);
// * one FP8 chunk (16 elements) lies inside one 128-wide scale block, so its partial sums are
//   scaled once per chunk;
// * the sums are reduced by warp shuffles, then across the block's warps through shared memory,
//   in a fixed order: no atomics, the same bits every run;
// * with kSiluMul, W is a merged [gate; up] of 2I rows and y [M, I] = silu(x @ gate^T) * (x @ up^T):
//   a block owns R / 2 gate rows and the R / 2 up rows that pair with them, so the SwiGLU of a
//   dense MLP needs no kernel of its own (both sums are rounded to bf16 first, as the unfused
//   GEMV's output would be);
// * launched with programmatic dependent launch (PDL, Hopper) when the caller asks: the kernel
//   may start while the previous one (the RMSNorm or SiLU-and-mul that writes x) finishes, and
//   issues its first loads of W, which no kernel writes, before it waits for x;
// * the decoder's residual add + RMSNorm can ride in the GEMVs around it (1 or 2 tokens), saving a
//   kernel launch and its wait twice a layer: kAddToY (o_proj, down_proj) adds the product, rounded
//   to bf16 as the plain GEMV's output would be, to y (the residual stream) in place; kNormX (qkv_proj,
//   gate_up_proj) reads x as the residual stream and computes W @ (RMSNorm(x) * norm_w) as
//   rsqrt(mean(x^2) + eps) * (W @ (x * norm_w)): the block reads all of x anyway, so the sum of squares
//   comes with the dot products and is reduced with them, and the norm costs no extra pass over x
//   (the normed x is not rounded to bf16 in between, unlike the separate norm kernel's output). How many
//   blocks an SM each one-token FP8 kernel fits is set where the kernel is declared (min_blocks).
//
// The constants of the one-token FP8 case are macros only so that an experiment
// (benchmarks/experiments/fp8_gemm.py) can build variants beside the default.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "tvm/ffi/optional.h"
#include "tvm_ffi_utils.h"

using tvm::ffi::Optional;

namespace {

#ifndef TPSERVE_GEMV_THREADS
#define TPSERVE_GEMV_THREADS 128
#endif
#ifndef TPSERVE_GEMV_FP8_ROWS
#define TPSERVE_GEMV_FP8_ROWS 8
#endif
#ifndef TPSERVE_GEMV_FP8_LOADS
#define TPSERVE_GEMV_FP8_LOADS 8
#endif
// 1: a block lets the next kernel launch once its first loads of W are out, not after its last (an experiment:
// the next GEMV's blocks then take the SM slots this one's finished blocks free and stream their W during its tail).
#ifndef TPSERVE_GEMV_EARLY_TRIGGER
#define TPSERVE_GEMV_EARLY_TRIGGER 0
#endif

constexpr int kThreads = TPSERVE_GEMV_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kVecBytes = 16;
constexpr int kLoadsInFlight = 8;
constexpr int kScaleBlock = 128;
constexpr int kMaxTokens = 8;
constexpr int kMaxSiluMulTokens = 2;

// A mixture-of-experts layer's experts at one token, routed in the kernels (no router kernel between the router's
// GEMV and them): each warp takes the token's top k from the router's bf16 logits itself (route_top_k).
// kExpertGateUp: the grid's y is the slot j of the top k, W the [2I, H] slice of its expert, y row j ([k, I]: SwiGLU).
// kExpertDown: x is those k rows [k * I] as one vector and row r of W the k experts' rows r side by side, each chunk's
// sum times its slot's routing weight (and FP8 block scale, or with kRowScale the slot's scale of the row):
// out [H] = sum_j weight_j * down[e_j] @ act_j.
enum Experts : int { kDense = 0, kExpertGateUp = 1, kExpertDown = 2 };
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 128;  // 4 logits a lane (Qwen3-MoE: 128)

// Rows a block of the expert GEMVs takes: bf16 4; FP8 gate_up TPSERVE_GEMV_FP8_ROWS as the dense kernels, FP8 down 2
// (Qwen3-30B-A3B-FP8's batch-1 step: 2 rows 0.984x 4 rows, 4 rows 0.949x 8; session 27).
#ifndef TPSERVE_GEMV_EXPERT_ROWS
#define TPSERVE_GEMV_EXPERT_ROWS 4
#endif
#ifndef TPSERVE_GEMV_FP8_DOWN_ROWS
#define TPSERVE_GEMV_FP8_DOWN_ROWS 2
#endif
// 1: the gate_up GEMV lets the down GEMV launch as soon as it has the logits (which down routes from), so down's blocks
// load their first weights during gate_up's run; 0: after gate_up's loads, as the dense GEMVs do (Qwen3-30B-A3B-FP8's
// batch-1 step 1.03x slower; session 27).
#ifndef TPSERVE_GEMV_EXPERT_EARLY
#define TPSERVE_GEMV_EXPERT_EARLY 1
#endif

// Rows per block. A block must bring enough W bytes to pay for itself: FP8 rows are half as
// long, so at one token a block takes 8 of them (8 KB of Qwen3-8B's K = 4096, one 16-byte load
// each for all kLoadsInFlight; with 2 rows half of those loads found no chunk and the kernel read
// 2.4-3.1 TB/s against bf16's 3.1-4.2 on the same shapes). Qwen3-8B FP8 batch-1 steps with other
// constants were all slower (docs/benchmarks.md, session 13): 16 loads (126 registers, 4 blocks an SM)
// by 12%, 4 rows by 16%, 16 loads only where the grid fits in one wave by 2%, and W unpacked one row at
// a time (72 registers, 7 blocks) by 4%. Session 14: the next step's loads issued before this step's math
// (the same bits) by 23% with 127 registers (4 blocks) and by 12% held to 96 (5 blocks).
// Session 17: W streamed into shared memory by cp.async, 2 / 3 / 4 steps of the block's chunks in flight
// (32-64 KB a block, no registers held: 7 / 4 / 3 blocks an SM), by 16% / 22% / 34%; W's loads with an L2
// prefetch of 256 bytes (ld...L2::256B) by 2.9% (bf16 4.5%); FP8 unpacked by integer operations into the f16 of
// W * 2^-8 (exact, the scale making up 2^8), not by the e4m3 conversion instruction, by 21%: the conversion is
// not what holds the kernel back. All correct (tests/gpu/test_gemv.py), all slower. Session 18: the products on tensor
// cores (mma.sync m16n8k16 f16, x staged as f16 in shared memory; 64 registers) by 29%; W's e4m3 pairs times x in
// f16x2 (HFMA2: half the instructions an element, a chunk's 16 products summed in f16) only 0.4-0.7% faster, within
// the noise, for f16 rounding: fewer instructions do not speed it up either.
// Session 21 (against the qkv kernel held to 6 blocks, below): o_proj's W loaded before the PDL wait, into
// registers 0.2% faster (noise) and through cp.async into shared memory 1.8% slower; 16 loads in flight in the
// kernels that add to the residual (o, down; 126 registers) 1.8% slower, in the SwiGLU ones 9% slower; every
// one-token FP8 kernel held to 7 blocks (72 registers) 0.7% slower, to 8 (64, spilling) 3% slower.
// Sessions 21-22: one token's bf16 MoE experts in this kernel (gate_up 4-row blocks per top-k slot, down over the k
// experts' rows side by side): the layer alone 0.965x the Triton small-batch kernels, but whole Qwen3-30B-A3B steps
// 1.027x slower with the router's top-k as a kernel of its own. Session 27 (kExpertGateUp / kExpertDown, routing in
// the kernels): FP8 experts 0.85x the Triton kernels' step, bf16 experts still 1.18x (so the layer takes it for FP8).
// Session 45: FP8 experts with a scale a row (kRowScale: gate_up's in its epilogue, down's per slot and row, times
// the routing weight, in shared memory): Qwen3-30B-A3B-FP8-dynamic's batch-1 step 0.816x bf16's, against 1.249x in
// the Triton kernels (H100).
template <int M, bool kFp8, int kMoe = kDense>
__host__ __device__ constexpr int rows_per_block() {
  return kMoe == kExpertDown && kFp8  ? TPSERVE_GEMV_FP8_DOWN_ROWS
         : kMoe != kDense && !kFp8   ? TPSERVE_GEMV_EXPERT_ROWS
         : kFp8 && M == 1            ? TPSERVE_GEMV_FP8_ROWS
                                     : (M <= 2 ? 2 : 4);
}

template <int M, bool kFp8>
__host__ __device__ constexpr int loads_in_flight() {
  return kFp8 && M == 1 ? TPSERVE_GEMV_FP8_LOADS : kLoadsInFlight;
}

// PDL: wait until the grids this one depends on have finished and their writes are visible
// (returns at once when the kernel was launched without PDL, or before Hopper).
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// PDL: let the next kernel launch (it waits for this one's writes itself).
__device__ __forceinline__ void allow_next_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// 16 bytes of W, not kept in L1 (read once; L1 holds x).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// 16 bytes of x, the previous kernel's output, by a coherent load after the PDL wait (volatile: the compiler
// keeps it there). Not __ldg: a read-only load (ld.global.nc) takes x as fixed for the kernel's life, which
// PDL breaks, and it may hit a line an earlier kernel on this SM cached from the same address (the graph
// pool reuses buffers) that griddepcontrol.wait does not invalidate. Measured (session 16, fused_norm_check):
// a tiny FP8 model's batch-1 logits in a CUDA graph with PDL were wrong by __ldg (relative difference 1.3),
// wrong by __ldg kept after the wait by a data dependency too, right by ld.global; the coherent load makes
// the Qwen3-8B FP8 step 3.3% slower (2.598 against 2.516 ms pipelined), bf16 no slower.
__device__ __forceinline__ uint4 load_input(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Elements [8 * j, 8 * j + 8) of a 16-byte chunk of W as floats (a bf16 chunk has 8, FP8 16).
template <bool kFp8>
__device__ __forceinline__ void unpack_w(const uint4& v, int j, float* out) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  if constexpr (kFp8) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t word = u[2 * j + i];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(word >> (16 * h)), __NV_E4M3);
        const float2 f = __half22float2(__half2(raw));
        out[4 * i + 2 * h] = f.x;
        out[4 * i + 2 * h + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = bf16_lo(u[i]);
      out[2 * i + 1] = bf16_hi(u[i]);
    }
  }
}

// SiLU(g) * u as FlashInfer's silu_and_mul computes it from bf16 g and u.
__device__ __forceinline__ float silu_mul(float g, float u) {
  g = __bfloat162float(__float2bfloat16(g));
  u = __bfloat162float(__float2bfloat16(u));
  return g / (1.f + __expf(-g)) * u;
}

enum Fuse : int { kPlain = 0, kNormX = 1, kAddToY = 2 };
constexpr int kMaxFusedTokens = 2;

struct Routing {
  const __nv_bfloat16* logits = nullptr;  // [E]: the router GEMV's output for the one token
  int num_experts = 0;
  int top_k = 0;
  bool renormalize = false;
  int64_t expert_bytes = 0;  // one expert's slice of W
  int64_t expert_scales = 0;  // FP8: one expert's scales (floats; kRowScale: one a row)
  int seg_chunks = 0;  // kExpertDown: 16-byte chunks of one expert's row (of I)
  int seg_scale_blocks = 0;  // kExpertDown, FP8: 128-wide scale blocks of one expert's row
};

// 16 bits an earlier kernel wrote, through L2 (the down kernel reads the logits before its PDL wait; L1 may hold a
// line of the graph pool's buffer from an earlier kernel on this SM).
__device__ __forceinline__ uint32_t load_input_u16(const void* p) {
  uint16_t v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// One warp: the token's top k experts by logit (ties to the lower id), as kernels/moe_small.py's router_top_k ranks
// them, calling on_slot(j, id, prob) in every lane for j < slots (<= top_k); with kProbs prob is the softmax over
// all experts in float32 (else 0). A logit becomes a 32-bit key (its bf16 bits made order-preserving, then
// 0xffff - id), so one redux.sync finds each slot; only the lane that held it takes the next of its own 4.
template <bool kProbs, typename OnSlot>
__device__ __forceinline__ void route_top_k(const Routing& routing, int slots, OnSlot on_slot) {
  constexpr int kPerLane = kMaxExperts / 32;
  const int lane = threadIdx.x % 32;
  uint32_t keys[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    keys[i] = 0;  // below every expert's key: no expert, or taken
    if (e < routing.num_experts) {
      const uint32_t b = load_input_u16(routing.logits + e);
      keys[i] = ((b & 0x8000u ? b ^ 0xffffu : b | 0x8000u) << 16) | (0xffffu - e);
    }
  }
  auto logit_of = [](uint32_t key) {
    const uint32_t o = key >> 16;
    return __uint_as_float((o & 0x8000u ? o & 0x7fffu : o ^ 0xffffu) << 16);
  };
  auto lane_max = [&]() {
    uint32_t m = keys[0];
#pragma unroll
    for (int i = 1; i < kPerLane; ++i) m = max(m, keys[i]);
    return m;
  };
  uint32_t lane_best = lane_max();
  float top = 0.f, denom = 1.f;
  if constexpr (kProbs) {
    top = logit_of(__reduce_max_sync(0xffffffffu, lane_best));
    denom = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (keys[i]) denom += expf(logit_of(keys[i]) - top);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) denom += __shfl_xor_sync(0xffffffffu, denom, off);
  }
  for (int j = 0; j < slots; ++j) {
    const uint32_t best = __reduce_max_sync(0xffffffffu, lane_best);
    if (lane_best == best) {  // (keys are unique: they hold the id)
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (keys[i] == best) keys[i] = 0;
      lane_best = lane_max();
    }
    on_slot(j, static_cast<int>(0xffffu - (best & 0xffffu)), kProbs ? expf(logit_of(best) - top) / denom : 0.f);
  }
}

// Blocks an SM a kernel is compiled for (__launch_bounds__; 0: the compiler's choice). Left alone, the one-token
// FP8 kernel with the fused norm and no SwiGLU (qkv_proj) takes 88 registers, 5 blocks an SM, so Qwen3-8B's 768
// blocks ran in 1.16 waves of 660; held to 6 it takes 80 without spilling and runs in one wave (the other one-token
// FP8 kernels take 80 and 76 registers, 6 blocks, by themselves).
#ifndef TPSERVE_GEMV_NORM_MIN_BLOCKS
#define TPSERVE_GEMV_NORM_MIN_BLOCKS 6
#endif
template <int M, bool kFp8, bool kSiluMul, int kFuse>
__host__ __device__ constexpr int min_blocks() {
  return kFp8 && M == 1 && !kSiluMul && kFuse == kNormX ? TPSERVE_GEMV_NORM_MIN_BLOCKS : 0;
}

template <int M, bool kFp8, bool kSiluMul, int kFuse, int kMoe = kDense, bool kRowScale = false>
__global__ void __launch_bounds__(kThreads, (min_blocks<M, kFp8, kSiluMul, kFuse>()))
    gemv_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                const float* __restrict__ scale_inv, const __nv_bfloat16* __restrict__ norm_w, float eps,
                __nv_bfloat16* y, int n, int k, Routing routing = {}) {
  constexpr bool kNorm = kFuse == kNormX;
  static_assert(kMoe == kDense || (M == 1 && (kFuse != kAddToY || kMoe == kExpertDown)),
                "the expert GEMVs: one token, only down adds to y");
  static_assert(kMoe != kExpertDown || (!kSiluMul && kFuse != kNormX), "the down GEMV fuses no norm");
  static_assert(!kRowScale || kFp8, "a scale per row: FP8 weights");
  constexpr bool kChunkScale = kFp8 && !kRowScale;  // each chunk's sums times its block's scale
  constexpr bool kScaled = kChunkScale || kMoe == kExpertDown;  // (and, kExpertDown, the routing weight)
  constexpr int R = rows_per_block<M, kFp8, kMoe>();
  constexpr int kOut = kSiluMul ? R / 2 : R;  // outputs per block: R / 2 (gate, up) row pairs
  static_assert(!kSiluMul || R % 2 == 0, "SiLU-and-mul pairs rows");
  constexpr int U = loads_in_flight<M, kFp8>() / R;  // chunks of each row loaded per step
  static_assert(U >= 1, "loads in flight must be a multiple of the rows per block");
  static_assert(kOut * M <= kThreads, "one thread per output");
  constexpr int kElems = kFp8 ? 16 : 8;       // W elements per chunk
  constexpr int kXVecs = kElems / 8;          // 16-byte loads of one token's x per chunk
  const size_t row_bytes = static_cast<size_t>(k) * (kFp8 ? 1 : 2);
  const int chunks = static_cast<int>(row_bytes / kVecBytes);
  const int n_out = kSiluMul ? n / 2 : n;
  const int n0 = blockIdx.x * kOut;
  // kExpertGateUp: the slot's expert, from the router's logits (so W's first loads wait for them). The down kernel
  // may launch once the logits are final, to route itself and load its first weights during this kernel's run.
  if constexpr (kMoe == kExpertGateUp) {
    wait_for_inputs();
    if (TPSERVE_GEMV_EXPERT_EARLY) allow_next_launch();
    int expert = 0;
    route_top_k<false>(routing, blockIdx.y + 1, [&](int j, int id, float) {
      if (j == static_cast<int>(blockIdx.y)) expert = id;
    });
    w += expert * routing.expert_bytes;
    if constexpr (kFp8) scale_inv += expert * routing.expert_scales;
    y += static_cast<size_t>(blockIdx.y) * n_out;
  }
  // kExpertDown: the k experts' slices, routing weights and (FP8) scale rows, routed before the PDL wait
  __shared__ const uint8_t* slot_w[kMoe == kExpertDown ? kMaxTopK : 1];
  __shared__ const float* slot_scales[kMoe == kExpertDown ? kMaxTopK : 1];
  __shared__ float slot_weight[kMoe == kExpertDown ? kMaxTopK : 1];
  // kExpertDown with kRowScale: each slot's routing weight times its expert's scale of the block's row r
  __shared__ float slot_row_scale[kMoe == kExpertDown && kRowScale ? kMaxTopK : 1][R];
  if constexpr (kMoe == kExpertDown) {
    if (threadIdx.x < 32) {
      float total = 0.f;
      route_top_k<true>(routing, routing.top_k, [&](int j, int id, float prob) {
        total += prob;
        if (threadIdx.x == 0) {
          slot_w[j] = w + id * routing.expert_bytes;
          slot_scales[j] = !kFp8      ? nullptr
                           : kRowScale ? scale_inv + id * routing.expert_scales
                                       : scale_inv + id * routing.expert_scales +
                                             static_cast<size_t>(min(n0, n - 1) / kScaleBlock) * routing.seg_scale_blocks;
          slot_weight[j] = prob;
        }
      });
      __syncwarp();
      if (threadIdx.x < routing.top_k) {  // rounded to bf16, as the router kernel stores the weights
        const float weight = routing.renormalize ? slot_weight[threadIdx.x] / total : slot_weight[threadIdx.x];
        slot_weight[threadIdx.x] = __bfloat162float(__float2bfloat16(weight));
      }
    }
    __syncthreads();
    if constexpr (kRowScale) {
      if (threadIdx.x < routing.top_k * R) {
        const int j = threadIdx.x / R, r = threadIdx.x % R;
        slot_row_scale[j][r] = slot_weight[j] * __ldg(slot_scales[j] + min(n0 + r, n - 1));
      }
      __syncthreads();
    }
  }

  // W row of the block's row r: rows past the end read the last one (kOut divides 128 and, with
  // kSiluMul, I: the gate rows share one scale row, the up rows another).
  auto w_row = [&](int r) {
    if constexpr (kSiluMul) return r < kOut ? min(n0 + r, n_out - 1) : n_out + min(n0 + r - kOut, n_out - 1);
    return min(n0 + r, n - 1);
  };
  // kExpertDown: a row of one expert is seg_chunks chunks, row_off[r] row r's offset within each expert's slice
  const size_t w_row_bytes = kMoe == kExpertDown ? static_cast<size_t>(routing.seg_chunks) * kVecBytes : row_bytes;
  size_t row_off[R];
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    row_off[r] = static_cast<size_t>(w_row(r)) * w_row_bytes;
    wrow[r] = reinterpret_cast<const uint4*>(w + row_off[r]);
  }
  const float* srow[2] = {nullptr, nullptr};  // scale rows of the first and (kSiluMul) the last kOut rows
  if constexpr (kChunkScale && kMoe != kExpertDown) {
    const size_t blocks_k = (k + kScaleBlock - 1) / kScaleBlock;
    srow[0] = scale_inv + static_cast<size_t>(w_row(0) / kScaleBlock) * blocks_k;
    srow[1] = scale_inv + static_cast<size_t>(w_row(R - 1) / kScaleBlock) * blocks_k;
  }

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  float sum_sq[M];  // kNormX: this thread's part of each token's sum of x^2
#pragma unroll
  for (int m = 0; m < M; ++m) sum_sq[m] = 0.f;

  // kAddToY: the residual values this thread adds to, read as soon as they are final (after the wait)
  const int out_r = threadIdx.x / M, out_m = threadIdx.x % M;
  const bool owns_out = threadIdx.x < kOut * M && n0 + out_r < n_out;
  const size_t out_idx = static_cast<size_t>(out_m) * n_out + n0 + out_r;
  float y_old = 0.f;
  auto wait_and_read_y = [&]() {
    wait_for_inputs();
    if constexpr (kFuse == kAddToY)
      if (owns_out) y_old = __bfloat162float(y[out_idx]);
  };

  // W's chunk c of row r (kExpertDown: chunk c % seg_chunks of the row in slot c / seg_chunks's expert)
  auto chunk_ptr = [&](int r, int c) -> const uint4* {
    if constexpr (kMoe == kExpertDown) {
      const int slot = c / routing.seg_chunks;
      return reinterpret_cast<const uint4*>(slot_w[slot] + row_off[r]) + (c - slot * routing.seg_chunks);
    }
    return wrow[r] + c;
  };

  bool waited = kMoe == kExpertGateUp;  // (which waited above)
  // Every thread takes every step, its loads and math guarded (the loop's bounds are the block's, not the
  // thread's): the Qwen3-8B FP8 step 2.1% faster than with each thread's own bounds, bf16 0.5% (session 17).
  for (int step = 0; step < chunks; step += kThreads * U) {
    const int base = step + threadIdx.x;
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * kThreads;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = c < chunks ? load_stream(chunk_ptr(r, c)) : make_uint4(0, 0, 0, 0);
    }
    if (!waited) {  // the first loads of W are in flight: now wait for x
      if (TPSERVE_GEMV_EARLY_TRIGGER) allow_next_launch();
      wait_and_read_y();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * kThreads;
      if (c >= chunks) break;
      float part[R][M];  // this chunk's sums: FP8 scales them once
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) part[r][m] = 0.f;
#pragma unroll
      for (int j = 0; j < kXVecs; ++j) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_w<kFp8>(wv[u][r], j, wf[r]);
        uint4 nv = make_uint4(0, 0, 0, 0);
        if constexpr (kNorm) nv = __ldg(reinterpret_cast<const uint4*>(norm_w) + c * kXVecs + j);
        const uint32_t nu[4] = {nv.x, nv.y, nv.z, nv.w};
#pragma unroll
        for (int m = 0; m < M; ++m) {
          // Through L1, the residual stream (kNormX) too: read through L2 only (ld.global.cg), every block's
          // pass over x waited on L2 and the fused Qwen3-8B step was 9% slower than the unfused (session 16).
          const int xi = m * (k / 8) + c * kXVecs + j;
          const uint4 xv = load_input(reinterpret_cast<const uint4*>(x) + xi);
          const uint32_t xu[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float x0 = bf16_lo(xu[i]), x1 = bf16_hi(xu[i]);
            if constexpr (kNorm) {
              sum_sq[m] = fmaf(x1, x1, fmaf(x0, x0, sum_sq[m]));
              x0 *= bf16_lo(nu[i]);
              x1 *= bf16_hi(nu[i]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
              part[r][m] = fmaf(wf[r][2 * i], x0, part[r][m]);
              part[r][m] = fmaf(wf[r][2 * i + 1], x1, part[r][m]);
            }
          }
        }
      }
      float scale[R];  // row r's factor for this chunk's sums
#pragma unroll
      for (int r = 0; r < R; ++r) scale[r] = 1.f;
      if constexpr (kMoe == kExpertDown) {
        const int slot = c / routing.seg_chunks;
        float s = slot_weight[slot];
        if constexpr (kChunkScale) s *= __ldg(slot_scales[slot] + (c - slot * routing.seg_chunks) * kElems / kScaleBlock);
#pragma unroll
        for (int r = 0; r < R; ++r) scale[r] = kRowScale ? slot_row_scale[slot][r] : s;
      } else if constexpr (kChunkScale) {
        const float first = __ldg(srow[0] + c * kElems / kScaleBlock);
        const float last = kSiluMul ? __ldg(srow[1] + c * kElems / kScaleBlock) : first;
#pragma unroll
        for (int r = 0; r < R; ++r) scale[r] = r < kOut ? first : last;
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
          acc[r][m] = kScaled ? fmaf(part[r][m], scale[r], acc[r][m]) : acc[r][m] + part[r][m];
    }
  }

  if (!waited) wait_and_read_y();  // y may still be read by the previous kernel
  allow_next_launch();  // (a no-op where EARLY_TRIGGER's came first)

  constexpr int kSums = R * M + (kNorm ? M : 0);  // the rows' dot products, then (kNormX) the sums of x^2
  __shared__ float warp_sums[kWarps][kSums];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto reduce_to_shared = [&](float v, int slot) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) warp_sums[warp][slot] = v;
  };
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) reduce_to_shared(acc[r][m], r * M + m);
  if constexpr (kNorm)
#pragma unroll
    for (int m = 0; m < M; ++m) reduce_to_shared(sum_sq[m], R * M + m);
  __syncthreads();
  auto block_sum = [&](int slot) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) s += warp_sums[v][slot];
    return s;
  };
  if (owns_out) {  // thread i < kOut * M writes the output of row i / M, token i % M
    const int i = threadIdx.x;
    const float rstd = kNorm ? rsqrtf(block_sum(R * M + out_m) / k + eps) : 1.f;
    // kRowScale: row r's scale of [N, 1] (an expert's: [rows, 1]); kExpertDown's are in its chunks' factors
    auto row_scale = [&](int r) { return kRowScale && kMoe != kExpertDown ? __ldg(scale_inv + w_row(r)) : 1.f; };
    float s = block_sum(i) * rstd * row_scale(out_r);
    if constexpr (kSiluMul) s = silu_mul(s, block_sum(i + kOut * M) * rstd * row_scale(out_r + kOut));
    if constexpr (kFuse == kAddToY) s = __bfloat162float(__float2bfloat16(s)) + y_old;
    y[out_idx] = __float2bfloat16(s);
  }
}

// What the kernel fuses (Fuse): kNormX's RMSNorm weight and epsilon.
struct Fusion {
  int kind = kPlain;
  const __nv_bfloat16* norm_w = nullptr;
  float eps = 0.f;
};

// The kernel over W [n, k] (kExpertGateUp: each expert's slice, grid_y = top k slots).
template <int M, bool kFp8, bool kSiluMul, int kFuse, int kMoe = kDense, bool kRowScale = false>
cudaError_t launch_grid(TensorView x, const void* w, int n, int k, const float* scale_inv, TensorView y, bool pdl,
                        Fusion fusion, Routing routing, int grid_y) {
  constexpr int kOut = kSiluMul ? rows_per_block<M, kFp8, kMoe>() / 2 : rows_per_block<M, kFp8, kMoe>();
  const int n_out = kSiluMul ? n / 2 : n;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((n_out + kOut - 1) / kOut, grid_y);
  config.blockDim = dim3(kThreads);
  config.stream = get_stream(x.device());
  config.attrs = attrs;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, gemv_kernel<M, kFp8, kSiluMul, kFuse, kMoe, kRowScale>,
                            static_cast<const __nv_bfloat16*>(x.data_ptr()), static_cast<const uint8_t*>(w), scale_inv,
                            fusion.norm_w, fusion.eps, static_cast<__nv_bfloat16*>(y.data_ptr()), n, k, routing);
}

template <int M, bool kFp8, bool kSiluMul, int kFuse, bool kRowScale = false>
cudaError_t launch(TensorView x, TensorView w, const float* scale_inv, TensorView y, bool pdl, Fusion fusion) {
  return launch_grid<M, kFp8, kSiluMul, kFuse, kDense, kRowScale>(x, w.data_ptr(), static_cast<int>(w.size(0)),
                                                                  static_cast<int>(w.size(1)), scale_inv, y, pdl,
                                                                  fusion, Routing{}, 1);
}

// The fused kernels, at the token counts of batch-1 and -2 decode (fewer instantiations to compile).
// Also every kind at one token with a scale per row (kRowScale).
template <int M, bool kFp8, bool kSiluMul, bool kRowScale = false>
cudaError_t launch_fused(TensorView x, TensorView w, const float* scale_inv, TensorView y, bool pdl, Fusion fusion) {
  if (fusion.kind == kNormX) return launch<M, kFp8, kSiluMul, kNormX, kRowScale>(x, w, scale_inv, y, pdl, fusion);
  if constexpr (!kSiluMul) {
    if (fusion.kind == kAddToY) return launch<M, kFp8, false, kAddToY, kRowScale>(x, w, scale_inv, y, pdl, fusion);
  }
  return launch<M, kFp8, kSiluMul, kPlain, kRowScale>(x, w, scale_inv, y, pdl, fusion);
}

template <bool kFp8>
void run(TensorView x, TensorView w, const float* scale_inv, TensorView y, bool pdl, bool silu_mul, Fusion fusion) {
  ffi::CUDADeviceGuard device_guard(x.device().device_id);
  cudaError_t status = cudaSuccess;
  if (silu_mul) {  // the rows at which a dense MLP takes the GEMV (fewer instantiations to compile)
    switch (x.size(0)) {
      case 1: status = launch_fused<1, kFp8, true>(x, w, scale_inv, y, pdl, fusion); break;
      case 2: status = launch_fused<2, kFp8, true>(x, w, scale_inv, y, pdl, fusion); break;
      default:
        TVM_FFI_LOG_AND_THROW(ValueError) << "gemv with SiLU-and-mul takes 1 or " << kMaxSiluMulTokens << " rows of x";
    }
  } else if (fusion.kind != kPlain) {
    switch (x.size(0)) {
      case 1: status = launch_fused<1, kFp8, false>(x, w, scale_inv, y, pdl, fusion); break;
      case 2: status = launch_fused<2, kFp8, false>(x, w, scale_inv, y, pdl, fusion); break;
      default: TVM_FFI_LOG_AND_THROW(ValueError) << "a fused gemv takes 1 or " << kMaxFusedTokens << " rows of x";
    }
  } else {
    switch (x.size(0)) {
      case 1: status = launch<1, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 2: status = launch<2, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 3: status = launch<3, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 4: status = launch<4, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 5: status = launch<5, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 6: status = launch<6, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 7: status = launch<7, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      case 8: status = launch<8, kFp8, false, kPlain>(x, w, scale_inv, y, pdl, fusion); break;
      default: TVM_FFI_LOG_AND_THROW(ValueError) << "gemv takes 1 to " << kMaxTokens << " rows of x";
    }
  }
  TVM_FFI_ICHECK(status == cudaSuccess) << "gemv launch failed: " << cudaGetErrorString(status);
}

bool aligned(TensorView t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % kVecBytes == 0; }

// The shapes and layouts the kernel reads; tpserve.kernels.gemv checks the same before calling.
void check(TensorView x, TensorView w, TensorView y, int elem_bytes, bool silu_mul) {
  CHECK_INPUT_AND_TYPE(x, dl_bfloat16);
  CHECK_INPUT(w);
  CHECK_INPUT_AND_TYPE(y, dl_bfloat16);
  TVM_FFI_ICHECK(x.ndim() == 2 && w.ndim() == 2 && y.ndim() == 2) << "gemv takes 2-D x, weight, y";
  TVM_FFI_ICHECK(x.size(1) == w.size(1) && y.size(0) == x.size(0) && y.size(1) == w.size(0) / (silu_mul ? 2 : 1))
      << "gemv: x [M, K], weight [N, K], y [M, N] (SiLU-and-mul: [M, N / 2]) do not match";
  TVM_FFI_ICHECK(!silu_mul || w.size(0) % 8 == 0) << "gemv: SiLU-and-mul needs N (2 I) a multiple of 8";
  TVM_FFI_ICHECK((w.size(1) * elem_bytes) % kVecBytes == 0 && aligned(x) && aligned(w))
      << "gemv: weight rows and pointers must be multiples of 16 bytes";
  TVM_FFI_ICHECK(w.size(0) > 0 && w.size(0) < (1LL << 30) && w.size(1) < (1LL << 30))
      << "gemv: N or K out of range";
}

// The fusion asked for: norm_w (bf16 [K]) for kNormX, or add_to_y for kAddToY, at 1 or 2 rows of x.
Fusion fusion_of(TensorView x, TensorView w, Optional<TensorView> norm_w, double eps, bool add_to_y, bool silu_mul) {
  Fusion fusion;
  if (!norm_w.has_value() && !add_to_y) return fusion;
  TVM_FFI_ICHECK(x.size(0) <= kMaxFusedTokens) << "a fused gemv takes 1 or " << kMaxFusedTokens << " rows of x";
  TVM_FFI_ICHECK(!(norm_w.has_value() && add_to_y)) << "gemv fuses either the RMSNorm of x or the add to y";
  if (add_to_y) {
    TVM_FFI_ICHECK(!silu_mul) << "gemv: add_to_y does not combine with SiLU-and-mul";
    fusion.kind = kAddToY;
    return fusion;
  }
  TensorView nw = norm_w.value();
  CHECK_INPUT_AND_TYPE(nw, dl_bfloat16);
  TVM_FFI_ICHECK(nw.ndim() == 1 && nw.size(0) == w.size(1) && aligned(nw))
      << "gemv: the norm weight must be [K], 16-byte aligned";
  fusion.kind = kNormX;
  fusion.norm_w = static_cast<const __nv_bfloat16*>(nw.data_ptr());
  fusion.eps = static_cast<float>(eps);
  return fusion;
}

}  // namespace

// y [M, N] = x [M, K] @ weight [N, K]^T, all bf16; pdl: launch with programmatic dependent launch;
// silu_mul: weight is [gate; up] and y [M, N / 2] = silu(x @ gate^T) * (x @ up^T);
// norm_w: x is normed first, RMSNorm(x) * norm_w with eps; add_to_y: y += the product (1 or 2 rows).
void gemv_bf16(TensorView x, TensorView weight, TensorView y, bool pdl, bool silu_mul, Optional<TensorView> norm_w,
               double eps, bool add_to_y) {
  check(x, weight, y, 2, silu_mul);
  CHECK_INPUT_TYPE(weight, dl_bfloat16);
  run<false>(x, weight, nullptr, y, pdl, silu_mul, fusion_of(x, weight, norm_w, eps, add_to_y, silu_mul));
}

// y [M, N] = x [M, K] @ (weight [N, K] * scale_inv per 128x128 block)^T; weight float8_e4m3fn,
// scale_inv float32 [ceil(N / 128), ceil(K / 128)].
void gemv_fp8(TensorView x, TensorView weight, TensorView scale_inv, TensorView y, bool pdl, bool silu_mul,
              Optional<TensorView> norm_w, double eps, bool add_to_y) {
  check(x, weight, y, 1, silu_mul);
  CHECK_INPUT_TYPE(weight, dl_float8_e4m3fn);
  CHECK_INPUT_AND_TYPE(scale_inv, dl_float32);
  TVM_FFI_ICHECK(scale_inv.ndim() == 2 &&
                 scale_inv.size(0) == (weight.size(0) + kScaleBlock - 1) / kScaleBlock &&
                 scale_inv.size(1) == (weight.size(1) + kScaleBlock - 1) / kScaleBlock)
      << "gemv: scale_inv must be [ceil(N / 128), ceil(K / 128)]";
  run<true>(x, weight, static_cast<const float*>(scale_inv.data_ptr()), y, pdl, silu_mul,
            fusion_of(x, weight, norm_w, eps, add_to_y, silu_mul));
}

// The same for one token, weight scaled per row (compressed-tensors' per-channel and per-tensor FP8): scale_inv
// float32 [N, 1].
void gemv_fp8_rows(TensorView x, TensorView weight, TensorView scale_inv, TensorView y, bool pdl, bool silu_mul,
                   Optional<TensorView> norm_w, double eps, bool add_to_y) {
  check(x, weight, y, 1, silu_mul);
  CHECK_INPUT_TYPE(weight, dl_float8_e4m3fn);
  CHECK_INPUT_AND_TYPE(scale_inv, dl_float32);
  TVM_FFI_ICHECK(x.size(0) == 1) << "gemv with a scale per row takes one row of x";
  TVM_FFI_ICHECK(scale_inv.ndim() == 2 && scale_inv.size(0) == weight.size(0) && scale_inv.size(1) == 1)
      << "gemv: scale_inv must be [N, 1]";
  ffi::CUDADeviceGuard device_guard(x.device().device_id);
  const float* s = static_cast<const float*>(scale_inv.data_ptr());
  const Fusion fusion = fusion_of(x, weight, norm_w, eps, add_to_y, silu_mul);
  const cudaError_t status = silu_mul ? launch_fused<1, true, true, true>(x, weight, s, y, pdl, fusion)
                                      : launch_fused<1, true, false, true>(x, weight, s, y, pdl, fusion);
  TVM_FFI_ICHECK(status == cudaSuccess) << "gemv launch failed: " << cudaGetErrorString(status);
}

// The routing a pair of expert GEMVs shares: the router's bf16 logits [1, E] of the one token and its top k.
static Routing routing_of(TensorView logits, int64_t top_k, bool renormalize, TensorView w, TensorView scales,
                          bool row_scales) {
  CHECK_INPUT_AND_TYPE(logits, dl_bfloat16);
  TVM_FFI_ICHECK(logits.ndim() == 2 && logits.size(0) == 1 && logits.size(1) >= 1 && logits.size(1) <= kMaxExperts &&
                 top_k >= 1 && top_k <= kMaxTopK && top_k <= logits.size(1) && logits.size(1) == w.size(0))
      << "expert gemv: logits must be bf16 [1, E] with E <= " << kMaxExperts << " experts and top_k <= "
      << kMaxTopK;
  CHECK_INPUT(w);
  TVM_FFI_ICHECK(w.ndim() == 3 && aligned(w)) << "expert gemv: the experts must be a 16-byte aligned [E, N, K]";
  Routing routing;
  routing.logits = static_cast<const __nv_bfloat16*>(logits.data_ptr());
  routing.num_experts = static_cast<int>(logits.size(1));
  routing.top_k = static_cast<int>(top_k);
  routing.renormalize = renormalize;
  routing.expert_bytes = w.size(1) * w.size(2) * (w.dtype() == dl_float8_e4m3fn ? 1 : 2);
  if (w.dtype() == dl_float8_e4m3fn && row_scales) {
    CHECK_INPUT_AND_TYPE(scales, dl_float32);
    TVM_FFI_ICHECK(scales.numel() == w.size(0) * w.size(1))
        << "expert gemv: FP8 experts scaled per row need one float32 scale per row of each expert, contiguous";
    routing.expert_scales = w.size(1);
  } else if (w.dtype() == dl_float8_e4m3fn) {
    CHECK_INPUT_AND_TYPE(scales, dl_float32);
    const int64_t row_blocks = (w.size(1) + kScaleBlock - 1) / kScaleBlock, k_blocks = (w.size(2) + kScaleBlock - 1) / kScaleBlock;
    TVM_FFI_ICHECK(scales.numel() == w.size(0) * row_blocks * k_blocks)
        << "expert gemv: FP8 experts need float32 scales per 128x128 block of each expert, contiguous";
    routing.expert_scales = row_blocks * k_blocks;
    routing.seg_scale_blocks = static_cast<int>(k_blocks);
  } else {
    CHECK_INPUT_TYPE(w, dl_bfloat16);
    TVM_FFI_ICHECK(!row_scales) << "expert gemv: a scale per row needs FP8 experts";
  }
  return routing;
}

// The multiple of 16 bytes an expert's intermediate size I must be (FP8 128-blocks: whole blocks).
static int64_t inter_multiple(bool fp8, bool row_scales) { return fp8 && !row_scales ? kScaleBlock : 16; }

// act [k, I] = SiLU(x @ gate.T) * (x @ up.T) of x [1, H] through the slice of gate_up [E, 2I, H] ([gate; up]; bf16, or
// FP8 with scales [E, 2, I / 128, H / 128], or with row_scales one a row, [E, 2, I, 1]) of each of the token's top k
// experts, routed from logits; norm_w: x is RMS-normed first, as in gemv_bf16.
void moe_gate_up(TensorView x, TensorView gate_up, TensorView scales, TensorView logits, int64_t top_k,
                 TensorView act, bool pdl, Optional<TensorView> norm_w, double eps, bool row_scales) {
  Routing routing = routing_of(logits, top_k, false, gate_up, scales, row_scales);
  const int64_t rows = gate_up.size(1), hidden = gate_up.size(2);
  const bool fp8 = gate_up.dtype() == dl_float8_e4m3fn;
  const int64_t multiple = fp8 ? inter_multiple(true, row_scales) : 4;
  CHECK_INPUT_AND_TYPE(x, dl_bfloat16);
  CHECK_INPUT_AND_TYPE(act, dl_bfloat16);
  TVM_FFI_ICHECK(x.ndim() == 2 && x.size(0) == 1 && x.size(1) == hidden && act.ndim() == 2 && act.size(0) == top_k &&
                 act.size(1) == rows / 2 && rows % (2 * multiple) == 0)
      << "expert gemv: x [1, H], gate_up [E, 2I, H] (I a multiple of " << multiple << "), act [k, I] do not match";
  TVM_FFI_ICHECK((hidden * (fp8 ? 1 : 2)) % kVecBytes == 0 && aligned(x))
      << "expert gemv: H must be a multiple of 16 bytes and x 16-byte aligned";
  ffi::CUDADeviceGuard device_guard(x.device().device_id);
  Fusion fusion = fusion_of(x, x, norm_w, eps, false, true);  // (x's width is W's K)
  const int n = static_cast<int>(rows), k = static_cast<int>(hidden);
  const float* s = fp8 ? static_cast<const float*>(scales.data_ptr()) : nullptr;
  const void* w = gate_up.data_ptr();
  cudaError_t status;
  if (fp8 && row_scales)
    status = fusion.kind == kNormX
                 ? launch_grid<1, true, true, kNormX, kExpertGateUp, true>(x, w, n, k, s, act, pdl, fusion, routing, top_k)
                 : launch_grid<1, true, true, kPlain, kExpertGateUp, true>(x, w, n, k, s, act, pdl, fusion, routing, top_k);
  else if (fp8)
    status = fusion.kind == kNormX
                 ? launch_grid<1, true, true, kNormX, kExpertGateUp>(x, w, n, k, s, act, pdl, fusion, routing, top_k)
                 : launch_grid<1, true, true, kPlain, kExpertGateUp>(x, w, n, k, s, act, pdl, fusion, routing, top_k);
  else
    status = fusion.kind == kNormX
                 ? launch_grid<1, false, true, kNormX, kExpertGateUp>(x, w, n, k, s, act, pdl, fusion, routing, top_k)
                 : launch_grid<1, false, true, kPlain, kExpertGateUp>(x, w, n, k, s, act, pdl, fusion, routing, top_k);
  TVM_FFI_ICHECK(status == cudaSuccess) << "expert gemv launch failed: " << cudaGetErrorString(status);
}

// out [1, H] = sum_j weight_j * act[j] @ down[e_j].T over the token's top k experts e_j, routed from logits as
// moe_gate_up routes them (weight_j: the softmax, optionally renormalised over the k, rounded to bf16); act [k, I],
// down [E, H, I] bf16, or FP8 with scales [E, H / 128, I / 128] (row_scales: [E, H, 1]). add_to_y: out (the residual
// stream) += the sum, rounded to bf16 first, as the dense down GEMV adds.
void moe_down(TensorView act, TensorView down, TensorView scales, TensorView logits, int64_t top_k, bool renormalize,
              TensorView out, bool pdl, bool add_to_y, bool row_scales) {
  Routing routing = routing_of(logits, top_k, renormalize, down, scales, row_scales);
  const int64_t hidden = down.size(1), inter = down.size(2);
  const bool fp8 = down.dtype() == dl_float8_e4m3fn;
  CHECK_INPUT_AND_TYPE(act, dl_bfloat16);
  CHECK_INPUT_AND_TYPE(out, dl_bfloat16);
  TVM_FFI_ICHECK(act.ndim() == 2 && act.size(0) == top_k && act.size(1) == inter && out.ndim() == 2 &&
                 out.size(0) == 1 && out.size(1) == hidden)
      << "expert gemv: act [k, I], down [E, H, I], out [1, H] do not match";
  const int64_t multiple = fp8 ? inter_multiple(true, row_scales) : 8;
  // (a thread fills each slot's scale of each of the block's rows)
  constexpr int kDownRows = rows_per_block<1, true, kExpertDown>();
  TVM_FFI_ICHECK(!row_scales || top_k * kDownRows <= kThreads)
      << "expert gemv: top_k " << top_k << " times the down kernel's rows a block exceeds its threads";
  TVM_FFI_ICHECK(inter % multiple == 0 && aligned(act))
      << "expert gemv: I must be a multiple of " << multiple << " and act 16-byte aligned";
  ffi::CUDADeviceGuard device_guard(act.device().device_id);
  routing.seg_chunks = static_cast<int>(inter * (fp8 ? 1 : 2) / kVecBytes);
  const float* s = fp8 ? static_cast<const float*>(scales.data_ptr()) : nullptr;
  const int n = static_cast<int>(hidden), k = static_cast<int>(top_k * inter);
  const void* w = down.data_ptr();
  const cudaError_t status =
      fp8 && row_scales
          ? (add_to_y ? launch_grid<1, true, false, kAddToY, kExpertDown, true>(act, w, n, k, s, out, pdl, {}, routing, 1)
                      : launch_grid<1, true, false, kPlain, kExpertDown, true>(act, w, n, k, s, out, pdl, {}, routing, 1))
      : fp8 ? (add_to_y ? launch_grid<1, true, false, kAddToY, kExpertDown>(act, w, n, k, s, out, pdl, {}, routing, 1)
                      : launch_grid<1, true, false, kPlain, kExpertDown>(act, w, n, k, s, out, pdl, {}, routing, 1))
          : (add_to_y ? launch_grid<1, false, false, kAddToY, kExpertDown>(act, w, n, k, s, out, pdl, {}, routing, 1)
                      : launch_grid<1, false, false, kPlain, kExpertDown>(act, w, n, k, s, out, pdl, {}, routing, 1));
  TVM_FFI_ICHECK(status == cudaSuccess) << "expert gemv launch failed: " << cudaGetErrorString(status);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gemv_bf16, gemv_bf16);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gemv_fp8, gemv_fp8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gemv_fp8_rows, gemv_fp8_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_gate_up, moe_gate_up);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_down, moe_down);
