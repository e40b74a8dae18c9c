// Split-KV decode attention over a dense page table whose splits merge inside a thread-block cluster
// (Hopper): out [B, Hq, 128] of q [B, Hq, 128] over bf16 caches [pages, page_size, Hkv, 128]. Built and
// called by tpserve.attention.cluster_decode.
//
// Why: at one token the decode step's attention is latency, not bytes (1 MB of KV at context 512 takes
// 0.25 us to read, the Triton kernel 7-10 us a layer). Its split programs write partials to global memory,
// count themselves with an atomic, and the last one reads every partial back: three round trips to L2 after
// the reads. Here the C splits of one (sequence, KV head) are one cluster of C blocks: each block reduces
// its tokens in shared memory and stores its partial of query head g into the shared memory of block
// g % C (distributed shared memory: stores, which wait for no reply), and after one cluster barrier each
// block merges its heads' partials from its own shared memory, with no global partials and no atomics.
//
// * grid (C, KV heads, batch), cluster (C, 1, 1), kThreads threads; block c takes the tokens
//   [c * per, (c + 1) * per) of its sequence, per = ceil(len / C), kStepTokens a step: a half-warp reads
//   one token's 256-byte row of K and of V (16 bytes a lane), kTokens rows a step;
// * the next step's rows are loaded before this step's math, their page ids one step earlier;
// * each warp keeps its own online softmax (base 2) over its tokens for the GROUP query heads of the KV head;
//   the block merges its warps, the owner block the cluster's blocks, in a fixed order: the same bits every run;
// * PDL: the first step's page ids and rows (but the newest token's, which the previous kernel writes)
//   are loaded before the wait for q; the next kernel may launch at once (it waits for this one's output).
//
// Session 22, first version (128 threads, 4 rows a half-warp, each block reading the others' partials after the
// barrier): correct, but alone 9.6 us at context 512 against the Triton kernel's 7.0 (Qwen3-8B heads, L2 cold),
// 23 against 13.7 at 4096, and whole Qwen3-8B steps 1.025x slower: one warp a scheduler left the per-lane dot
// products and shuffles latency-bound (~1.9 us a 32-token step), and the merge's remote reads waited in turn.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "tvm_ffi_utils.h"

namespace cg = cooperative_groups;

namespace {

constexpr int kHeadDim = 128;
#ifndef TPSERVE_DECODE_THREADS
#define TPSERVE_DECODE_THREADS 256
#endif
constexpr int kThreads = TPSERVE_DECODE_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCluster = 16;
constexpr int kMaxGroup = 8;
// Partials a block receives (it merges query heads g = rank, rank + splits, ...): splits * ceil(G / splits) at most
constexpr int kMaxSlots = kMaxCluster + kMaxGroup - 1;
#ifndef TPSERVE_DECODE_TOKENS
#define TPSERVE_DECODE_TOKENS 2
#endif
constexpr int kTokens = TPSERVE_DECODE_TOKENS;     // rows a half-warp loads a step
constexpr int kStepTokens = kWarps * 2 * kTokens;  // tokens a block takes a step
constexpr float kNegInf = -__builtin_huge_valf();

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int* table;  // [B, W] page ids (the host's: no kernel writes them)
  const int* lens;   // [B]
  __nv_bfloat16* out;
  int64_t q_sb, q_sh, kv_sp, kv_ss, kv_sh, table_sb, o_sb, o_sh;
  int page;
  float scale_log2;
};

__device__ __forceinline__ void wait_for_inputs() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_launch() { asm volatile("griddepcontrol.launch_dependents;"); }
// A cluster barrier in two halves: a block may write another's shared memory only once that block runs.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// 16 bytes of a cache row written by an earlier kernel (not L1-allocated: read once).
__device__ __forceinline__ uint4 load_row(const __nv_bfloat16* p) {
  uint4 v;
  asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// 16 bytes the previous kernel wrote, read after the PDL wait (volatile: kept after it; coherent, as in gemv.cu).
__device__ __forceinline__ uint4 load_after_wait(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_lo(u[i]);
    f[2 * i + 1] = bf16_hi(u[i]);
  }
}
// exp2(x - m) of a score against a running max, 0 for a masked score (also where m is -inf)
__device__ __forceinline__ float weight(float x, float m) { return x == kNegInf ? 0.f : exp2f(x - m); }

template <int G>
__global__ void __launch_bounds__(kThreads, 1) cluster_decode_kernel(Params p) {
  allow_next_launch();
  cluster_arrive();  // (waited for before the first store into another block's shared memory)
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, half = lane / 16, dl = lane % 16;
  const int len = p.lens[b];
  const int per = (len + splits - 1) / splits;
  const int t0 = rank * per, t1 = min(len, t0 + per);
  const int steps = t1 > t0 ? (t1 - t0 + kStepTokens - 1) / kStepTokens : 0;
  const int* table = p.table + b * p.table_sb;
  auto token = [&](int step, int j) { return t0 + step * kStepTokens + (warp * 2 + half) * kTokens + j; };
  auto row_offset = [&](int id, int t) {
    return static_cast<int64_t>(id) * p.kv_sp + (t % p.page) * p.kv_ss + h * p.kv_sh + dl * 8;
  };
  auto load_ids = [&](int step, int* ids) {
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const int t = token(step, j);
      ids[j] = t < t1 ? table[t / p.page] : 0;
    }
  };
  auto load_rows = [&](int step, const int* ids, uint4* kr, uint4* vr, bool skip_newest) {
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const int t = token(step, j);
      if (t < t1 && !(skip_newest && t == len - 1)) {
        const int64_t off = row_offset(ids[j], t);
        kr[j] = load_row(p.k + off);
        vr[j] = load_row(p.v + off);
      } else {
        kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  int ids[kTokens], next_ids[kTokens];
  uint4 kc[kTokens], vc[kTokens];
  if (steps > 0) {
    load_ids(0, ids);
    load_rows(0, ids, kc, vc, true);
  }
  if (steps > 1) load_ids(1, next_ids);
  wait_for_inputs();
  uint4 qv[G];  // the group's query rows, this lane's 8 dims
#pragma unroll
  for (int g = 0; g < G; ++g) qv[g] = load_after_wait(p.q + b * p.q_sb + (h * G + g) * p.q_sh + dl * 8);
  if (steps > 0) {
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const int t = token(0, j);
      if (t == len - 1 && t < t1) {
        const int64_t off = row_offset(ids[j], t);
        kc[j] = load_after_wait(p.k + off);
        vc[j] = load_after_wait(p.v + off);
      }
    }
  }

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }
  for (int step = 0; step < steps; ++step) {
    uint4 kn[kTokens], vn[kTokens];
    if (step + 1 < steps) load_rows(step + 1, next_ids, kn, vn, false);
    if (step + 2 < steps) load_ids(step + 2, next_ids);
    float s[kTokens][G];
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      float kf[8];
      unpack(kc[j], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float qf[8];
        unpack(qv[g], qf);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(qf[i], kf[i], dot);
        s[j][g] = dot;
      }
    }
#pragma unroll
    for (int off = 8; off > 0; off /= 2)
#pragma unroll
      for (int j = 0; j < kTokens; ++j)
#pragma unroll
        for (int g = 0; g < G; ++g) s[j][g] += __shfl_xor_sync(0xffffffffu, s[j][g], off);
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const bool valid = token(step, j) < t1;
#pragma unroll
      for (int g = 0; g < G; ++g) s[j][g] = valid ? s[j][g] * p.scale_log2 : kNegInf;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float top = s[0][g];
#pragma unroll
      for (int j = 1; j < kTokens; ++j) top = fmaxf(top, s[j][g]);
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 16));  // the warp's max (both half-warps)
      const float new_m = fmaxf(m[g], top);
      if (new_m == kNegInf) continue;  // (warp-uniform) no token of this warp yet
      const float alpha = weight(m[g], new_m);
      m[g] = new_m;
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= alpha;
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        const float w = weight(s[j][g], new_m);
        l[g] += w;
        float vf[8];
        unpack(vc[j], vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(w, vf[i], acc[g][i]);
      }
    }
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      kc[j] = kn[j];
      vc[j] = vn[j];
    }
  }
  // The two half-warps took different tokens against the same running max: their sums add.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    l[g] += __shfl_xor_sync(0xffffffffu, l[g], 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], 16);
  }

  __shared__ float warp_m[kWarps][G], warp_l[kWarps][G];
  __shared__ float warp_o[kWarps][G][kHeadDim];
  __shared__ float recv_m[kMaxSlots], recv_l[kMaxSlots];  // the partials of the query heads this block merges
  __shared__ float recv_o[kMaxSlots][kHeadDim];
  if (lane < 16) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) warp_o[warp][g][dl * 8 + i] = acc[g][i];
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  cluster_wait();  // (the arrive at the start) every block of the cluster runs: its shared memory may be written
  // The block's partial of query head g goes to block g % splits, slot rank * per_owner + g / splits, by stores
  // into that block's shared memory (they need no reply, unlike reads).
  const int per_owner = (G + splits - 1) / splits;
  for (int idx = threadIdx.x; idx < G * kHeadDim; idx += kThreads) {
    const int g = idx / kHeadDim, d = idx % kHeadDim;
    float top = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, warp_m[w][g]);
    float o = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float e = weight(warp_m[w][g], top);
      o = fmaf(e, warp_o[w][g][d], o);
      total = fmaf(e, warp_l[w][g], total);
    }
    const int owner = g % splits, slot = rank * per_owner + g / splits;
    *cluster.map_shared_rank(&recv_o[slot][d], owner) = o;
    if (d == 0) {
      *cluster.map_shared_rank(&recv_m[slot], owner) = top;
      *cluster.map_shared_rank(&recv_l[slot], owner) = total;
    }
  }
  cluster.sync();  // every partial is in its owner's shared memory
  for (int idx = threadIdx.x; idx < per_owner * kHeadDim; idx += kThreads) {
    const int local = idx / kHeadDim, d = idx % kHeadDim, g = rank + local * splits;
    if (g >= G) break;
    float top = kNegInf;
    for (int r = 0; r < splits; ++r) top = fmaxf(top, recv_m[r * per_owner + local]);
    float o = 0.f, total = 0.f;
    for (int r = 0; r < splits; ++r) {
      const int slot = r * per_owner + local;
      const float e = weight(recv_m[slot], top);
      o = fmaf(e, recv_o[slot][d], o);
      total = fmaf(e, recv_l[slot], total);
    }
    p.out[b * p.o_sb + (h * G + g) * p.o_sh + d] = __float2bfloat16(o / total);
  }
}

template <int G>
cudaError_t launch(const Params& params, int splits, int kv_heads, int batch, bool pdl, cudaStream_t stream) {
  static const cudaError_t allowed =  // clusters of more than 8 blocks are "non-portable": asked for once
      cudaFuncSetAttribute(cluster_decode_kernel<G>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (allowed != cudaSuccess) return allowed;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = splits;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(splits, kv_heads, batch);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, cluster_decode_kernel<G>, params);
}

}  // namespace

// out [B, Hq, 128] = attention of q [B, Hq, 128] over k_cache / v_cache [pages, page_size, Hkv, 128] (bf16, last
// dim contiguous) through page_table [B, W] (int32) and seq_lens [B] (int32); scale_log2 = softmax scale * log2(e);
// splits: blocks a (sequence, KV head) cluster, 1 to 16.
void cluster_decode(TensorView q, TensorView k_cache, TensorView v_cache, TensorView page_table, TensorView seq_lens,
                    TensorView out, double scale_log2, int64_t splits, bool pdl) {
  CHECK_CUDA(q);
  CHECK_INPUT_TYPE(q, dl_bfloat16);
  CHECK_INPUT_TYPE(k_cache, dl_bfloat16);
  CHECK_INPUT_TYPE(v_cache, dl_bfloat16);
  CHECK_INPUT_AND_TYPE(page_table, dl_int32);
  CHECK_INPUT_AND_TYPE(seq_lens, dl_int32);
  CHECK_INPUT_TYPE(out, dl_bfloat16);
  TVM_FFI_ICHECK(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4)
      << "cluster decode: q and out [B, Hq, D], caches [pages, page_size, Hkv, D]";
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2);
  TVM_FFI_ICHECK(q.size(2) == kHeadDim && k_cache.size(3) == kHeadDim && out.size(0) == batch &&
                 out.size(1) == heads && out.size(2) == kHeadDim)
      << "cluster decode: head_dim must be " << kHeadDim;
  TVM_FFI_ICHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                 k_cache.stride(0) == v_cache.stride(0) && k_cache.stride(1) == v_cache.stride(1) &&
                 k_cache.stride(2) == v_cache.stride(2))
      << "cluster decode: rows must be contiguous and the caches laid out alike";
  TVM_FFI_ICHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup)
      << "cluster decode: query heads must group over KV heads, at most " << kMaxGroup << " a KV head";
  TVM_FFI_ICHECK(splits >= 1 && splits <= kMaxCluster) << "cluster decode: splits must be 1 to " << kMaxCluster;
  TVM_FFI_ICHECK(page_table.ndim() == 2 && page_table.size(0) >= batch && seq_lens.numel() >= batch)
      << "cluster decode: a page table row and a length per sequence";
  Params params;
  params.q = static_cast<const __nv_bfloat16*>(q.data_ptr());
  params.k = static_cast<const __nv_bfloat16*>(k_cache.data_ptr());
  params.v = static_cast<const __nv_bfloat16*>(v_cache.data_ptr());
  params.table = static_cast<const int*>(page_table.data_ptr());
  params.lens = static_cast<const int*>(seq_lens.data_ptr());
  params.out = static_cast<__nv_bfloat16*>(out.data_ptr());
  params.q_sb = q.stride(0);
  params.q_sh = q.stride(1);
  params.kv_sp = k_cache.stride(0);
  params.kv_ss = k_cache.stride(1);
  params.kv_sh = k_cache.stride(2);
  params.table_sb = page_table.stride(0);
  params.o_sb = out.stride(0);
  params.o_sh = out.stride(1);
  params.page = static_cast<int>(k_cache.size(1));
  params.scale_log2 = static_cast<float>(scale_log2);
  if (batch == 0) return;
  ffi::CUDADeviceGuard device_guard(q.device().device_id);
  const cudaStream_t stream = get_stream(q.device());
  const int s = static_cast<int>(splits), kvh = static_cast<int>(kv_heads), bs = static_cast<int>(batch);
  cudaError_t status = cudaSuccess;
  switch (heads / kv_heads) {
    case 1: status = launch<1>(params, s, kvh, bs, pdl, stream); break;
    case 2: status = launch<2>(params, s, kvh, bs, pdl, stream); break;
    case 3: status = launch<3>(params, s, kvh, bs, pdl, stream); break;
    case 4: status = launch<4>(params, s, kvh, bs, pdl, stream); break;
    case 5: status = launch<5>(params, s, kvh, bs, pdl, stream); break;
    case 6: status = launch<6>(params, s, kvh, bs, pdl, stream); break;
    case 7: status = launch<7>(params, s, kvh, bs, pdl, stream); break;
    default: status = launch<8>(params, s, kvh, bs, pdl, stream); break;
  }
  TVM_FFI_ICHECK(status == cudaSuccess) << "cluster decode launch failed: " << cudaGetErrorString(status);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(cluster_decode, cluster_decode);
