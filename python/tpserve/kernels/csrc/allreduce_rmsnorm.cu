// All-reduce + residual add + RMSNorm in one kernel, through peer GPU memory: FlashInfer's port of
// TensorRT-LLM's fusion kernels (one-shot Lamport, two-shot), instantiated only for the pattern
// tpserve runs (kARResidualRMSNorm, float32 accumulation, 2/4/8 ranks, bf16/fp16). FlashInfer's own
// trtllm_comm module instantiates every pattern, dtype and rank count and takes minutes to build.
// The workspace (peer buffers and flags) is allocated in Python (tpserve.distributed.fused_allreduce).
#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"
#include "tvm_ffi_utils.h"

using namespace flashinfer::trtllm_allreduce_fusion;

namespace {

template <typename T, int NRanks>
cudaError_t launch(AllReduceFusionParams<T> const& params) {
  return allreduce_fusion_kernel_launcher<AllReduceFusionPattern::kARResidualRMSNorm, T, NRanks,
                                          true>(params, /*launch_with_pdl=*/true);
}

template <typename T>
cudaError_t launch_for_ranks(AllReduceFusionParams<T> const& params) {
  switch (params.nranks) {
    case 2:
      return launch<T, 2>(params);
    case 4:
      return launch<T, 4>(params);
    case 8:
      return launch<T, 8>(params);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
void run(TensorView x, TensorView residual, TensorView norm_out, TensorView gamma, double eps,
         TensorView workspace, int64_t world_size, int64_t rank, bool use_oneshot) {
  AllReduceFusionParams<T> params;
  params.nranks = static_cast<int>(world_size);
  params.rank = static_cast<int>(rank);
  params.hidden_dim = static_cast<int>(x.size(x.ndim() - 1));
  params.size = static_cast<int>(x.numel());
  params.workspace = reinterpret_cast<void**>(workspace.data_ptr());
  params.allreduce_in = x.data_ptr();
  params.allreduce_out = nullptr;
  params.residual_in = residual.data_ptr();
  params.residual_out = residual.data_ptr();
  params.norm_out = norm_out.data_ptr();
  params.quant_out = nullptr;
  params.scale_out = nullptr;
  params.rms_gamma = gamma.data_ptr();
  params.rms_eps = static_cast<float>(eps);
  params.scale_factor = nullptr;
  params.use_oneshot = use_oneshot;
  params.pattern = AllReduceFusionPattern::kARResidualRMSNorm;
  params.trigger_completion_at_end = true;
  params.stream = get_stream(x.device());
  cudaError_t status = launch_for_ranks<T>(params);
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "all-reduce + add + RMSNorm failed: " << cudaGetErrorString(status);
}

}  // namespace

// x: [tokens, hidden], this rank's partial sum; residual: [tokens, hidden], updated in place to
// x summed over ranks + residual; norm_out (may be x): RMSNorm of that times gamma.
void allreduce_add_rmsnorm(TensorView x, TensorView residual, TensorView norm_out, TensorView gamma,
                           double eps, TensorView workspace, int64_t world_size, int64_t rank,
                           bool use_oneshot) {
  ffi::CUDADeviceGuard device_guard(x.device().device_id);
  TVM_FFI_ICHECK(x.dtype() == residual.dtype() && x.dtype() == norm_out.dtype() &&
                 x.dtype() == gamma.dtype())
      << "all-reduce + RMSNorm: x, residual, norm_out and gamma must share one dtype";
  switch (encode_dlpack_dtype(x.dtype())) {
    case bfloat16_code:
      run<__nv_bfloat16>(x, residual, norm_out, gamma, eps, workspace, world_size, rank,
                         use_oneshot);
      break;
    case float16_code:
      run<half>(x, residual, norm_out, gamma, eps, workspace, world_size, rank, use_oneshot);
      break;
    default:
      TVM_FFI_LOG_AND_THROW(NotImplementedError) << "all-reduce + RMSNorm takes bf16 or fp16";
  }
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(allreduce_add_rmsnorm, allreduce_add_rmsnorm);
