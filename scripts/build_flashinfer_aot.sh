#!/usr/bin/env bash
# Prebuild FlashInfer's norm, rotary and SiLU-and-mul modules for sm_90a on a machine without a
# GPU, into ./.fiaot/<module>/<module>.so (ignored by git; carry it to the GPU machine, where
# gpu_suite.sh copies it into flashinfer/data/aot so FlashInfer loads it instead of JIT-building
# for ~2 minutes). Needs nvcc 13 at /usr/local/cuda, ninja, and pip access; run from the repo root:
#   bash scripts/build_flashinfer_aot.sh
# If FlashInfer cannot load a module built here it logs a warning and JIT-builds it as before.
set -euo pipefail
work=${TMPDIR:-/tmp}/tpserve-fiaot
site=$work/site
cuda=$work/cuda
mkdir -p "$work" "$site" "$cuda/include" "$cuda/lib64/stubs" .fiaot

# FlashInfer from the carried wheel; tvm-ffi and nvidia-ml-py for this machine's Python.
python3 -m pip install -q --no-deps --target "$site" .whl/flashinfer_python-0.7.0-py3-none-any.whl \
  "apache-tvm-ffi==0.1.15.post2" nvidia-ml-py
# The CUDA toolkit here lacks the cuBLAS and cuRAND headers that FlashInfer's norm sources include.
# The FP8 GEMM also includes and links NVRTC (DeepGEMM's JIT), which this toolkit lacks too.
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/wheels" "nvidia-cublas>=13,<13.1" "nvidia-curand>=10.4,<10.5" \
  "nvidia-cuda-nvrtc>=13,<13.1"
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" 'nvidia/cu13/include/*' 'nvidia/cu13/lib/*' -d "$work/headers" 2>/dev/null || true; done
# A CUDA_HOME that is /usr/local/cuda plus those headers, and a libcuda stub to link with
# (the driver library is resolved on the GPU machine).
ln -sfn /usr/local/cuda/bin "$cuda/bin"
for f in /usr/local/cuda/include/* "$work"/headers/nvidia/cu13/include/*; do ln -sf "$f" "$cuda/include/"; done
for f in /usr/local/cuda/lib64/*; do ln -sf "$f" "$cuda/lib64/"; done
ln -sf "$work/headers/nvidia/cu13/lib/libnvrtc.so.13" "$cuda/lib64/libnvrtc.so"
# The stub defines the driver functions the FP8 GEMM calls: the linker drops a library that provides
# none of a module's symbols, and the module then fails to load ("undefined symbol: cuLibraryLoadData").
for f in cuGetErrorString cuKernelGetName cuLibraryEnumerateKernels cuLibraryGetKernelCount cuLibraryLoadData \
  cuLibraryUnload; do echo "void $f(void) {}"; done > "$work/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" "$work/libcuda_stub.c"

# tpserve's own CUDA modules too (the GEMV, the fused all-reduce + RMSNorm), for sm_90a alone: a
# tenth of the size the GPU machine builds (every supported architecture). Their names carry their
# source's hash (kernels.jit_name), so a later edit of a kernel is rebuilt there, never loaded stale.
export PYTHONPATH=$site:$PWD/python FLASHINFER_WORKSPACE_BASE=$work/ws FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=$cuda MAX_JOBS=2
python3 - "$@" <<'PY'
import shutil
import sys
from pathlib import Path
from flashinfer.jit.activation import gen_act_and_mul_module
from flashinfer.jit.norm import gen_norm_module
from flashinfer.jit.rope import gen_rope_module
from tpserve.distributed import fused_allreduce
from tpserve.kernels import gemv

specs = [gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu"), gemv.jit_spec(),
         fused_allreduce.jit_spec()]
for extra in sys.argv[1:]:
    if extra == "fp8_gemm":
        from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module

        specs.append(gen_fp8_blockscale_gemm_sm90_module())
    elif extra.startswith("gemv:"):
        specs.append(gemv.jit_spec(gemv._defines(extra.removeprefix("gemv:"))))
    else:
        sys.exit(f"unknown extra module {extra!r}: fp8_gemm or gemv:NAME=VALUE[,NAME=VALUE]")
for spec in specs:
    spec.build()
    target = Path(".fiaot") / spec.name
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(spec.jit_library_path, target / f"{spec.name}.so")
    print("built", target / f"{spec.name}.so")
PY
