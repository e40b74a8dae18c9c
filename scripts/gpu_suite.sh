#!/usr/bin/env bash
# The GPU run, on the lent GPU machine, from the repository root (carry .whl .models .fiaot):
#   bash scripts/gpu_suite.sh "$OUT" [stage ...]
# Installs the carried wheels, warms FlashInfer's JIT kernels, runs tests/gpu, then the
# benchmarks; every stage has a time limit so the whole run ends inside the device call.
# Writes $OUT/suite.log, $OUT/results/*.json (one per benchmark) and, when it compiled new
# FlashInfer JIT modules, $OUT/jit_aot.tgz: those modules' .so files laid out as FlashInfer's AOT
# modules. Unpack it into the .fiaot carried next time (tar xzf jit_aot.tgz -C .fiaot) and
# FlashInfer loads them with no build (the `warm` stage's ~2 minutes): 9 MB for one model shape's
# kernels, where the whole JIT cache (.ficache, with its objects) packs to 15 MB. tpserve's own
# modules carry their source's hash in their names (kernels.jit_name), so a changed kernel is
# rebuilt, never loaded stale; FlashInfer's are tied to its wheel (0.7.0: a new wheel needs a new .fiaot).
# What waits for nvidia-h200-x2 (issues 13, 14, 15, 18), about three calls of 600 s:
#   tests_tp2_f32 ar_fused tpdecode32_fused | serving32_after plan_tp2 | moe30_tp2 tests_dp2 tests_multinode serving06_dp
# gpu_tests: any pytest files or node ids (GPU_TESTS), e.g. a change's own GPU tests; session 41 ran every tests/gpu file
#   but test_float32.py and the two-GPU ones this way on H100s (docs/results/2026-12-06-session41/).
# shape_tests passed whole on an H100 in session 40 (37 tests, 43 s once its FlashInfer JIT modules were built: 8 minutes on a
#   fresh machine; carry them from .gpu/jit, e.g. scripts/gpu_carry.sh 'q_f16_dtype_kv_f16' 'xqa_input_f16', within the 64 MiB).
# moe30_offline with session 36's prefill kernels ran on the H200 in session 39: 6,025 tok/s = 79.3% (session 35: 6,077).
#   What is left in that prefill step (H100): grouped GEMMs 52%, cuBLAS qkv/o 16%, the sum over top-k 4.7%, SiLU-and-mul 3.8%.
# On one H200 (session 9): `auto` takes XQA for FP8 caches only (xqa_kv4, xqa_variants, xqa_a3b_fp8 show why).
# On one H200, session 14: attn_sweep and attn_setting (then named attn_prefetch) measured the Triton decode
# kernel's prefetch of K and V before the PDL wait, now the default (triton_tests: its GPU tests). The FP8 GEMV
# issuing its next step's loads before this step's math lost (csrc/gemv.cu's comment). Issue 16 needs ~34 us
# off the FP8 step: its GEMVs run at 3.3-3.9 TB/s where bf16's run at 3.9-4.3 (graph_profile). Every variant
# that holds more loads in registers lost; W staged in shared memory by cp.async lost too (session 17; TMA bulk copies untried).
# Issue 14: A3B attention still ends 10.8 us after the rotary kernel (8B FP8: 6.6); more splits lost (attn_a3b).
# Session 16: the GEMV's __ldg of x read stale lines under PDL (FP8 logits in graphs wrong: fuse_check); x is now read
# coherently, which cost the FP8 step 3.3% (gemv_variants8): 0.625x. Session 17: the GEMV's block-wide loop bounds and
# the fused add + RMSNorm (now defaults) put it at 0.612-0.615x (engine_variants8, three calls); x or W staged in shared
# memory (X_SMEM, FP8_ASYNC), integer FP8 unpacking (FP8_CVT) and an L2 prefetch hint (W_PREFETCH) all lost (removed).
# Session 18: the one-token FP8 GEMV on tensor cores (FP8_MMA) lost by 29%, its products in f16x2 (FP8_HALF, half the
# instructions) gained 0.4-0.7% (engine_variants8): removed; the FP8 GEMV is bound by neither instructions nor registers
# alone. The MoE down kernel's prefetch before its PDL wait (a3b_variants, then TPSERVE_MOE_DOWN_PREFETCH) took 0.8% off A3B,
# the MoE layer's norm in its router GEMV and first expert kernel 2.1% (a3b_variants "unfused_moe:TPSERVE_MOE_FUSE_NORM=0").
# Session 19: q/k norm + rotary + KV store inside the Triton decode attention kernel lost 2-4% (removed); the MoE router's top-k
# inside the small-batch expert kernels took 0.8% off A3B batch 1 (a3b_variants "unrouted:TPSERVE_MOE_FUSE_ROUTER=0").
# Session 19 also found the add + RMSNorm fused into the GEMVs 4.6% slower at batch 2 (norm_b2; now fused at one token only)
# and routing inside the MoE kernels slower from batch 2 (a3b_variants with A3B_BATCHES). Session 20: the next kernel's
# weights prefetched into L2 (by the GEMV or by decode attention) lost 3-17% (removed); silu_b2 kept the SwiGLU epilogue
# at batch 2; a3b_variants swept TPSERVE_MOE_SMALL and TPSERVE_TRITON_DECODE (down BLOCK_K 256, 16 splits for A3B: 0.927x).
# Session 24: the q/k norm, rotary and KV store in qkv_proj's GEMV epilogue lost 2.1% in both dtypes (removed).
# Session 25: alone, the one-token FP8 GEMVs read as fast as a math-free read in their order (read_pattern, gemv_m1); the
# SwiGLU GEMV on a persistent grid lost 1.4-7% (engine_variants8 with PERSIST=N, gemv_variant_tests; removed), and 4 or 2
# rows a block in the FP8 o and down GEMVs 1.7% / 6.2% (FP8_ADD_ROWS=N, removed).
# Session 26: FP8 o/down capped at 4-5 blocks an SM (dynamic shared memory), the SwiGLU GEMV with 64 threads: noise; the MLP
# streamed (the down GEMV polling counters the SwiGLU GEMV releases, x from L2) correct but 1.2x (FP8) / 1.4x (bf16) slower.
# Build what a stage needs on the CPU machine first (build_flashinfer_aot.sh fp8_gemm gemv:...) and carry it, with the
# sm90 bf16 prefill and decode modules returned by earlier calls (scripts/gpu_carry.sh).
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR [stage ...]}
shift
stages=${*:-warm tests decode06 prefill06 offline06 decode8 prefill8 offline06_eager}
stages=$(echo " $stages " | sed 's/ moe30 / moe30_tests moe30_offline moe30_decode /')  # moe30: all three
log=$out/suite.log
results=$out/results
mkdir -p "$results" .ficache

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && find /tmp/site -exec touch -h -d '2020-01-01' {} + \
  && export PYTHONPATH=/tmp/site:$PWD/python FLASHINFER_WORKSPACE_BASE=$PWD/.ficache PYTHONUNBUFFERED=1 \
     MAX_JOBS=16 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
     NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRTLLM_DG_CACHE_DIR=$PWD/.ficache/deepgemm || exit 1
# FlashInfer's norm, rotary and SiLU-and-mul modules, prebuilt off the GPU machine
# (scripts/build_flashinfer_aot.sh), load as AOT modules: no JIT build on this machine.
if [ -d .fiaot ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && cp -r .fiaot/. /tmp/site/flashinfer/data/aot/
fi
touch /tmp/ficache-marker

pack_jit_modules() {  # the FlashInfer JIT modules built in this run, as AOT modules, into $out/jit_aot.tgz
  [ -n "$(find .ficache -newer /tmp/ficache-marker -name '*.so' 2>/dev/null)" ] || return 0
  local pack=/tmp/jit-aot-pack so name
  rm -rf $pack && mkdir -p $pack
  for so in .ficache/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    name=$(basename "$so" .so)
    [ "$name" = "$(basename "$(dirname "$so")")" ] || continue  # the module itself, not a helper library
    mkdir -p "$pack/$name" && cp "$so" "$pack/$name/"
  done
  tar czf "$out/jit_aot.tgz" -C $pack . && echo "new FlashInfer JIT modules: unpack $out/jit_aot.tgz into .fiaot" | tee -a "$log"
}

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v '^Loading weights' | tee -a "$log"
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - start)) s" | tee -a "$log"
}

serving_dir() {  # serving_dir CONFIG_DIR OUT_DIR: a model dir for the server (config + the real tokenizer)
  mkdir -p "$2" && cp "$1"/*.json "$2"/ && tar xJf .models/qwen3-tokenizer.tar.xz -C "$2" && echo "$2"
}

small=.models/Qwen3-0.6B
large=.models/Qwen3-8B
a3b=tests/data/configs/Qwen3-30B-A3B  # issue 14: the real config, random weights
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$log"
for s in $stages; do
  case $s in
    warm)
      stage warm 300 python3 scripts/warm_flashinfer.py --head-dim 128 --dtype bfloat16
      pack_jit_modules ;;
    warm_attn)  # FlashInfer's bf16 decode and prefill attention and the FP8 GEMM (the rest carried: build_flashinfer_aot.sh)
      stage warm_attn 200 python3 scripts/warm_flashinfer.py --parts decode,prefill,fp8_gemm
      pack_jit_modules ;;
    tests) stage tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    decode06) stage decode06 150 python3 benchmarks/decode_latency.py --model $small --out $results/decode_qwen3_0.6b.json ;;
    prefill06) stage prefill06 60 python3 benchmarks/prefill_throughput.py --model $small --out $results/prefill_qwen3_0.6b.json ;;
    offline06) stage offline06 150 python3 benchmarks/offline_throughput.py --model $small --out $results/offline_qwen3_0.6b_graphs.json ;;
    offline06_eager) stage offline06_eager 180 python3 benchmarks/offline_throughput.py --model $small --cuda-graph-max-bs 0 --out $results/offline_qwen3_0.6b_eager.json ;;
    decode8) stage decode8 120 python3 benchmarks/decode_latency.py --model $large --batch-sizes 1,64 --contexts 512 --out $results/decode_qwen3_8b.json ;;
    prefill8) stage prefill8 90 python3 benchmarks/prefill_throughput.py --model $large --lengths 1024,4096,8192,16384 --out $results/prefill_qwen3_8b.json ;;
    profile06) stage profile06 90 python3 benchmarks/profile_decode.py --model $small --batch-sizes 1,64,256 --out $results/profile_qwen3_0.6b.json ;;
    fused_tests) stage fused_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_kernels.py tests/gpu/test_flashinfer_and_graphs.py ;;
    decode06_fused) stage decode06_fused 45 python3 benchmarks/decode_latency.py --model $small --batch-sizes 1,64,256 --contexts 512 --out $results/decode_qwen3_0.6b_fused.json ;;
    decode06_torch) stage decode06_torch 35 env TPSERVE_FUSED_KERNELS=0 python3 benchmarks/decode_latency.py --model $small --batch-sizes 1,64,256 --contexts 512 --modes graph --out $results/decode_qwen3_0.6b_torchops.json ;;
    decode8_fused) stage decode8_fused 45 python3 benchmarks/decode_latency.py --model $large --batch-sizes 1,64 --contexts 512 --out $results/decode_qwen3_8b_fused.json ;;
    profile8_b1) stage profile8_b1 35 python3 benchmarks/profile_decode.py --model $large --batch-sizes 1 --out $results/profile_qwen3_8b_bs1.json ;;
    offline06_fused) stage offline06_fused 75 python3 benchmarks/offline_throughput.py --model $small --out $results/offline_qwen3_0.6b_fused.json ;;
    sampler) stage sampler 90 python3 benchmarks/sampler_latency.py --batch-sizes 1,16,64,256 --out $results/sampler.json ;;
    ceilings) stage ceilings 20 python3 benchmarks/ceilings.py --out $results/ceilings.json ;;
    profile8) stage profile8 120 python3 benchmarks/profile_decode.py --model $large --batch-sizes 1,64 --out $results/profile_qwen3_8b.json ;;
    offline06_nooverlap) stage offline06_nooverlap 90 python3 benchmarks/offline_throughput.py --model $small --disable-overlap --out $results/offline_qwen3_0.6b_nooverlap.json ;;
    offline06_nographs) stage offline06_nographs 120 python3 benchmarks/offline_throughput.py --model $small --cuda-graph-max-bs 0 --out $results/offline_qwen3_0.6b_nographs.json ;;
    offline14) stage offline14 200 python3 benchmarks/offline_throughput.py --model .models/Qwen3-14B --out $results/offline_qwen3_14b.json ;;
    hf06) stage hf06 150 python3 benchmarks/offline_throughput.py --model $small --hf-baseline --num-requests 64 --out $results/offline_qwen3_0.6b_hf.json ;;
    prefill8k) stage prefill8k 60 python3 benchmarks/prefill_throughput.py --model $large --lengths 8192 --out $results/prefill_qwen3_8b_8k.json ;;
    serving06)  # a real server (dummy weights, the real Qwen3 tokenizer) and the online client
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      python3 -m tpserve --model $srv --load-format dummy --port $port > $out/server.log 2>&1 &
      spid=$!
      for _ in $(seq 120); do python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break; sleep 1; done
      grep -E "attention|graphs|KV pages|listening|ready" $out/server.log | head -8 | tee -a "$log"
      stage serving06 150 python3 benchmarks/serving.py --url http://127.0.0.1:$port --rates 16,inf --num-requests 200 --out $results/serving_qwen3_0.6b.json
      kill -TERM $spid; wait $spid; echo "server exit $?" | tee -a "$log" ;;
    tests_dp2) stage tests_dp2 240 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_dp2.py ;;
    tests_multinode)  # issue 15: two "nodes" as two launches on this host, NCCL across them (2 GPUs)
      stage tests_multinode 240 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_multinode_gpu.py ;;
    serving06_dp)  # issue 15: DP 2 x TP 1 against DP 1 of Qwen3-0.6B through HTTP, all at once, in one call (2 GPUs)
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      stage serving06_dp 540 python3 benchmarks/serving.py --launch $srv --dp-sizes 1,2 --rates inf --num-requests 1024 \
        --server-args "--num-tokenizers 2" --server-log $out/server_dp.log --out $results/serving_qwen3_0.6b_dp.json ;;
    serving06_dp_whole)  # the same without streaming: if the API server or the client bound the streamed run
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      stage serving06_dp_whole 480 python3 benchmarks/serving.py --launch $srv --dp-sizes 1,2 --rates inf --num-requests 1024 \
        --no-stream --server-args "--num-tokenizers 2" --server-log $out/server_dp_whole.log \
        --out $results/serving_qwen3_0.6b_dp_whole.json ;;
    offline06_trace) stage offline06_trace 150 python3 benchmarks/offline_throughput.py --model $small --trace --out $results/offline_qwen3_0.6b_traced.json ;;
    offline14_trace) stage offline14_trace 240 python3 benchmarks/offline_throughput.py --model .models/Qwen3-14B --trace --out $results/offline_qwen3_14b_traced.json ;;
    decode06_pipe) stage decode06_pipe 90 python3 benchmarks/decode_latency.py --model $small --batch-sizes 1,64,256 --contexts 512 --modes graph,pipelined --out $results/decode_qwen3_0.6b_pipelined.json ;;
    decode8_pipe) stage decode8_pipe 120 python3 benchmarks/decode_latency.py --model $large --batch-sizes 1,64 --contexts 512 --modes graph,pipelined --out $results/decode_qwen3_8b_pipelined.json ;;
    # the CUDA small-M GEMV (issues 14, 16): its tests, then against cuBLAS, Triton's and FlashInfer's GEMMs at 1..8 tokens
    gemv_tests) stage gemv_tests 300 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gemv.py tests/gpu/test_fp8_gpu.py \
      -k "cuda or test_gemv" ;;
    # session 25: the one-token GEMVs' read order without math (read_pattern.py), beside the GEMVs themselves
    read_pattern) stage read_pattern 150 python3 benchmarks/experiments/read_pattern.py --configs tests/data/configs/Qwen3-8B \
      --out $results/read_pattern.json ;;
    gemv_m1) stage gemv_m1 300 python3 benchmarks/experiments/fp8_gemm.py --configs tests/data/configs/Qwen3-8B --ms 1 \
      --variants "${GEMV_VARIANTS:-cuda,cuda:FP8_ROWS=4,cuda:FP8_LOADS=16,cuda:FP8_ROWS=16:FP8_LOADS=16,bf16_cuda}" \
      --out $results/gemv_m1.json ;;
    gemv_variant_tests)  # tests/gpu/test_gemv.py on a GEMV built with GEMV_TEST_DEFINES (TPSERVE_GEMV_DEFINES: its own module)
      stage gemv_variant_tests 200 env TPSERVE_GEMV_DEFINES="${GEMV_TEST_DEFINES:?}" python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_gemv.py -k "${GEMV_TESTS:-gemv}" ;;
    gemv_tests_k)  # tests/gpu/test_gemv.py -k GEMV_TESTS on the default GEMV
      stage gemv_tests_k 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py -k "${GEMV_TESTS:?}" ;;
    gemv_bench) stage gemv_bench 420 python3 benchmarks/experiments/fp8_gemm.py --ms 1,2,4,8 --variants cuda,bf16_cuda,flashinfer,w8a8 \
      --configs tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B,$a3b --out $results/fp8_gemm_cuda.json ;;
    fp8_quant_tests) stage fp8_quant_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -k quantization_fp8_on_gpu ;;
    gemv_only) stage gemv_only 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py ;;
    gemv_fp8_tests) stage gemv_fp8_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py tests/gpu/test_fp8_gpu.py ;;
    gemv_variants)  # the GEMV's launch (PDL or not) and one-token FP8 tiles, each GEMM after an RMSNorm as in the model
      stage gemv_variants 240 python3 benchmarks/experiments/fp8_gemm.py --ms 1,2 --after-norm \
        --variants cuda,cuda:nopdl,cuda:FP8_LOADS=16,cuda:FP8_ROWS=16:FP8_LOADS=16,cuda:FP8_ROWS=4,cuda:THREADS=64,bf16_cuda,bf16_cuda:nopdl \
        --configs tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B --out $results/gemv_variants.json ;;
    gemm) stage gemm 240 python3 benchmarks/experiments/gemm_small_m.py --models $small,$large,.models/Qwen3-14B --out $results/gemm_small_m.json ;;
    xqa)  # decode attention: FlashInfer's decode wrapper against XQA, bf16 and FP8 KV, 0.6B/8B/32B heads
      stage xqa 420 python3 benchmarks/experiments/xqa_decode.py --out $results/xqa_decode.json
      pack_jit_modules ;;
    xqa_small)  # the same at the small bf16 batches where auto's switch to the decode wrapper sits
      stage xqa_small 200 python3 benchmarks/experiments/xqa_decode.py --kv-dtypes bf16 --batch-sizes 1,4,8,16,32,48,64 \
        --out $results/xqa_decode_small.json ;;
    xqa_tests) stage xqa_tests 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_decode_kernels.py tests/gpu/test_flashinfer_and_graphs.py \
        tests/gpu/test_fp8_gpu.py::test_fp8_kv_cache_on_gpu ;;
    xqa_only)  # XQA's kernel and engine tests alone (its modules build on first use, ~10 s each)
      stage xqa_only 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels.py -k xqa ;;
    xqa_engine_tests)  # the engine tests whose batch-1 decode steps took XQA in session 8 (bf16, auto then)
      stage xqa_engine_tests 260 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_overlap.py tests/gpu/test_moe.py \
        tests/gpu/test_structured.py ;;
    xqa_kv4)  # bf16 and FP8 decode attention at few KV heads (Qwen3-30B-A3B: 32:4; 32B at TP 2: 32:4; TP 4: 16:2), small batches
      stage xqa_kv4 240 python3 benchmarks/experiments/xqa_decode.py --heads 32:4,16:2,32:8,64:8 --batch-sizes 1,2,4,16 \
        --contexts 512,4096 --out $results/xqa_decode_kv4.json
      for dec in auto flashinfer; do
        stage moe30_b1_$dec 120 python3 benchmarks/decode_latency.py --model $a3b --batch-sizes 1,4 --contexts 512,4096 \
          --modes graph --decode-attention $dec --out $results/decode_a3b_b1_dec_$dec.json
      done ;;
    xqa_variants)  # batch-1 decode, XQA as auto launches it, without PDL, at 8 sub-sequences, against the wrapper
      for m in $a3b $large; do
        n=$(basename $m)
        for v in "auto" "flashinfer" "auto TPSERVE_XQA_PDL=0" "auto XQA_NB_SUB_SEQ=8"; do
          set -- $v
          stage xqa_var_${n}_$1_${2:-} 90 env ${2:-} python3 benchmarks/experiments/xqa_engine_variants.py --model $m --batch-sizes 1 \
            --contexts 512,4096 --modes graph --decode-attention $1
        done
      done ;;
    xqa_a3b_fp8)  # Qwen3-30B-A3B (4 KV heads) decode over an FP8 cache: auto (XQA) against the decode wrapper
      for dec in auto flashinfer; do
        stage xqa_a3b_fp8_$dec 120 python3 benchmarks/decode_latency.py --model $a3b --batch-sizes 1,64 --contexts 512,4096 \
          --modes graph --decode-attention $dec --kv-cache-dtype fp8_e4m3 --out $results/decode_a3b_fp8kv_dec_$dec.json
      done ;;
    xqa_table)  # XQA alone with the table as wide as the step needs, then as wide as the engine's graphs pass it
      for w in 0 2560; do
        stage xqa_table_$w 120 python3 benchmarks/experiments/xqa_decode.py --heads 32:4,32:8 --batch-sizes 1,64 \
          --contexts 512,4096 --table-pages $w --out $results/xqa_table_$w.json
      done ;;
    smoke_tests) stage smoke_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_overlap.py \
        tests/gpu/test_flashinfer_and_graphs.py tests/gpu/test_moe.py ;;
    xqa_decode8_b1)  # Qwen3-8B bf16 decode at batch 1 and 4, XQA (forced: --decode-attention xqa) against the decode wrapper
      for dec in xqa flashinfer; do
        stage xqa_decode8_b1_$dec 120 python3 benchmarks/decode_latency.py --model $large --batch-sizes 1,4 \
          --contexts 512,4096 --modes graph --decode-attention $dec --out $results/decode8_b1_dec_$dec.json
      done ;;
    xqa_offline06)  # workload A, Qwen3-0.6B: XQA (auto) against FlashInfer's decode wrapper, bf16 and FP8 KV
      for kv in auto fp8_e4m3; do for dec in auto flashinfer; do
        stage xqa_offline06_${kv}_$dec 150 python3 benchmarks/offline_throughput.py --model $small --kv-cache-dtype $kv \
          --decode-attention $dec --out $results/offline06_kv_${kv}_dec_$dec.json
      done; done ;;
    xqa_offline8)  # workload A, Qwen3-8B: bf16 pages against FP8 pages (XQA), decode attention auto
      for kv in auto fp8_e4m3; do
        stage xqa_offline8_$kv 150 python3 benchmarks/offline_throughput.py --model $large --kv-cache-dtype $kv \
          --out $results/offline8_kv_$kv.json
      done ;;
    xqa_decode8)  # Qwen3-8B decode steps: XQA (auto) against the decode wrapper, bf16 and FP8 KV
      for kv in auto fp8_e4m3; do for dec in auto flashinfer; do
        stage xqa_decode8_${kv}_$dec 120 python3 benchmarks/decode_latency.py --model $large --batch-sizes 1,16,64,256 \
          --contexts 512,4096 --modes graph --iters 10 --kv-cache-dtype $kv --decode-attention $dec --out $results/decode8_kv_${kv}_dec_$dec.json
      done; done ;;
    attn) stage attn 200 python3 benchmarks/experiments/attention_decode.py --out $results/attention_decode.json ;;
    attn_layouts)  # page layout and size of the decode kernels (Qwen3-0.6B and -8B heads)
      for layout in NHD HND; do for ps in 16 64; do
        stage attn_${layout}_$ps 120 python3 benchmarks/experiments/attention_decode.py --heads 16:8,32:8 --batch-sizes 64,256 \
          --contexts 512,1024,4096 --variants decode_cuda_cores,decode_tensor_cores --layout $layout --page-size $ps \
          --out $results/attention_decode_${layout}_$ps.json
      done; done ;;
    profile06_cat) stage profile06_cat 90 python3 benchmarks/profile_decode.py --model $small --batch-sizes 1,64,256 --out $results/profile_qwen3_0.6b.json ;;
    profile8_cat) stage profile8_cat 90 python3 benchmarks/profile_decode.py --model $large --batch-sizes 1,64 --out $results/profile_qwen3_8b.json ;;
    profile14_cat) stage profile14_cat 90 python3 benchmarks/profile_decode.py --model .models/Qwen3-14B --batch-sizes 64,256 --out $results/profile_qwen3_14b.json ;;
    # ---- two GPUs (issue 13) ----
    warm_ar)  # FlashInfer's JIT build in the background while the all-reduce sizes are timed
      python3 scripts/warm_flashinfer.py --head-dim 128 --dtype bfloat16 > $out/warm.log 2>&1 &
      wpid=$!
      stage allreduce 150 python3 benchmarks/allreduce_latency.py --tp-size 2 --out $results/allreduce_tp2.json
      wait $wpid; echo "=== warm rc=$?: $(tail -1 $out/warm.log)" | tee -a "$log"
      pack_jit_modules ;;
    tests_tp2) stage tests_tp2 300 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp2.py ;;
    tests_tp2_fixed) stage tests_tp2_fixed 200 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp2.py -k "agrees or server" ;;
    tpdecode32) stage tpdecode32 300 python3 benchmarks/tp_decode_latency.py --model .models/Qwen3-32B --tp-size 2 \
      --batch-sizes 1,64 --all-reduce auto,nccl --allreduce-json $results/allreduce_tp2.json --out $results/tp_decode_qwen3_32b.json ;;
    serving32_before|serving32_after)  # workload A on Qwen3-32B TP 2 through HTTP; before = mixed 8192-token chunks + NCCL only
      srv=$(serving_dir .models/Qwen3-32B /tmp/qwen3-32b)
      if [ $s = serving32_before ]; then sa="--mixed-prefill-tokens 8192 --all-reduce nccl"; else sa=""; fi
      stage $s 330 python3 benchmarks/serving.py --launch $srv --tp-size 2 --server-args "$sa" --rates inf,4 \
        --num-requests 256,64 --server-log $out/server_$s.log --out $results/$s.json ;;
    serving32_nccl)  # the after configuration with NCCL for every all-reduce: what the peer-memory kernels are worth
      srv=$(serving_dir .models/Qwen3-32B /tmp/qwen3-32b)
      stage serving32_nccl 200 python3 benchmarks/serving.py --launch $srv --tp-size 2 --server-args "--all-reduce nccl" \
        --rates inf --num-requests 256 --server-log $out/server_nccl.log --out $results/serving32_nccl.json ;;
    tests_gpu_all) stage tests_gpu_all 330 python3 -m pytest -q -p no:cacheprovider tests/gpu \
      -k "not (all_reduce_equal and (nccl or one_shot or two_shot))" ;;
    serving32_rate4)
      srv=$(serving_dir .models/Qwen3-32B /tmp/qwen3-32b)
      stage serving32_rate4 200 python3 benchmarks/serving.py --launch $srv --tp-size 2 --rates 4 --num-requests 64 \
        --server-log $out/server_rate4.log --out $results/serving32_rate4.json ;;
    offline14_tp1) stage offline14_tp1 200 python3 benchmarks/offline_throughput.py --model .models/Qwen3-14B --out $results/offline_qwen3_14b_tp1.json ;;
    offline14_tp2) stage offline14_tp2 200 python3 benchmarks/offline_throughput.py --model .models/Qwen3-14B --tp-size 2 --out $results/offline_qwen3_14b_tp2.json ;;
    tests_tp2_f32) stage tests_tp2_f32 300 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp2.py tests/gpu/test_float32.py ;;
    profile32_tp2) stage profile32_tp2 200 python3 benchmarks/profile_decode.py --model .models/Qwen3-32B --tp-size 2 \
      --batch-sizes 1,64,256 --out $results/profile_qwen3_32b_tp2.json ;;
    profile14_tp1|profile14_tp2)  # where a decode step's time goes at TP 1 and TP 2 (the 14B TP 2 / TP 1 ratio)
      stage $s 150 python3 benchmarks/profile_decode.py --model .models/Qwen3-14B --tp-size ${s#profile14_tp} \
        --batch-sizes 64,256 --out $results/$s.json ;;
    plan_tp2) stage plan_tp2 300 python3 benchmarks/plan_vs_measured.py --calibrate --case .models/Qwen3-8B:1 \
      --case .models/Qwen3-8B:2 --case .models/Qwen3-32B:2 --out $results/plan_vs_measured_tp2.json ;;
    ar_fused)  # issue 13: the all-reduce fused with the residual add and RMSNorm (--all-reduce fused):
      # its build (with FlashInfer's other kernels), latency by size against the unfused paths, TP 2 tests
      stage ar_fused_warm 150 python3 scripts/warm_flashinfer.py --head-dim 128 --dtype bfloat16
      stage ar_fused_latency 150 python3 benchmarks/allreduce_latency.py --tp-size 2 --out $results/allreduce_fused_tp2.json
      stage ar_fused_tests 240 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp2.py -k fused
      pack_jit_modules ;;
    tpdecode32_fused)  # Qwen3-32B TP 2 decode steps, auto against fused (after ar_fused, for its latency table)
      aj=$results/allreduce_fused_tp2.json
      stage tpdecode32_fused 300 python3 benchmarks/tp_decode_latency.py --model .models/Qwen3-32B --tp-size 2 \
        --batch-sizes 1,64,256 --all-reduce auto,fused $([ -f $aj ] && echo --allreduce-json $aj) \
        --out $results/tp_decode_qwen3_32b_fused.json ;;
    # ---- Qwen3-30B-A3B (issue 14); after warm (the bf16 MoE test builds FlashInfer's kernels otherwise and
    # overran 120 s). moe30 on one GPU (~6 min), moe30_tp2 on two ----
    rest_tests)  # the single-GPU tests engine_tests leaves out: the MoE kernels, decode attention kernels, float32 engines
      stage rest_tests 450 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe.py tests/gpu/test_decode_kernels.py \
        tests/gpu/test_float32.py ;;
    gpu_tests)  # GPU_TESTS: pytest files or node ids (e.g. a new test file with the tests its change touches); GPU_LIMIT: s
      stage gpu_tests "${GPU_LIMIT:-300}" python3 -m pytest -q -s -p no:cacheprovider ${GPU_TESTS:?} ;;
    shape_tests)  # what no other stage runs: MoE kernels in float32/float16, float16 engines, FP8 outside bf16, head_dim
      # 64/256, an odd tied vocabulary (tests/gpu/test_dtypes_and_shapes.py), and the float32 MoE model test_moe.py has
      # SHAPE_TESTS: other pytest node ids, in the order to run them; SHAPE_LIMIT: seconds
      stage shape_tests "${SHAPE_LIMIT:-480}" python3 -m pytest -v -s --tb=short -p no:cacheprovider \
        ${SHAPE_TESTS:-tests/gpu/test_dtypes_and_shapes.py tests/gpu/test_moe.py::test_moe_model_float32_triton_matches_torch_experts} ;;
    moe30_tests) stage moe30_tests 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe.py ;;
    moe_tests_k)  # tests/gpu/test_moe.py -k MOE_TESTS, e.g. "expert_gemv"
      stage moe_tests_k 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe.py -k "${MOE_TESTS:?}" ;;
    moe_tests_fused)  # test_moe.py with the add + RMSNorm in the GEMVs (TPSERVE_GEMV_FUSE_NORM=1)
      stage moe_tests_fused 240 env TPSERVE_GEMV_FUSE_NORM=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe.py ;;
    moe30_offline)
      stage moe30_offline 180 python3 benchmarks/offline_throughput.py --model $a3b --trace --out $results/offline_qwen3_30b_a3b_traced.json
      stage moe30_roofline 30 python3 benchmarks/roofline.py $results/offline_qwen3_30b_a3b_traced.json --model $a3b --peak-tflops 766 ;;
    prefill_kernels)  # one prefill step of Qwen3-30B-A3B (8192 tokens in 16 prompts, as workload A's; PREFILL_MODELS: other
      # configs) by kernel, on this checkout, then on old/python where an older checkout's python/ is copied in (which
      # kernels a change moved)
      for m in ${PREFILL_MODELS:-$a3b}; do
        name=$(basename $m)
        stage prefill_kernels_$name 200 python3 benchmarks/experiments/prefill_kernels.py --model $m --tokens 8192 --seqs 16 \
          ${PREFILL_ARGS:-} --out $results/prefill_kernels_$name.json
        for variant in ${PREFILL_VARIANTS:-}; do  # NAME=VALUE environment settings, one run each
          stage prefill_kernels_${name}_$variant 200 env $variant python3 benchmarks/experiments/prefill_kernels.py --model $m \
            --tokens 8192 --seqs 16 --label $variant --out $results/prefill_kernels_${name}_${variant%%=*}.json
        done
        if [ -d old/python ]; then
          stage prefill_kernels_${name}_old 300 env PYTHONPATH=/tmp/site:$PWD/old/python python3 \
            benchmarks/experiments/prefill_kernels.py --model $m --tokens 8192 --seqs 16 ${PREFILL_ARGS:-} --label old \
            --out $results/prefill_kernels_${name}_old.json
        fi
      done ;;
    moe30_profile)  # Qwen3-30B-A3B decode at batch 64 and 256: the CUDA graph's kernels, by kind
      stage moe30_profile 150 python3 benchmarks/profile_decode.py --model $a3b --batch-sizes 64,256 --graph-only \
        --out $results/profile_a3b.json ;;
    moe30_decode_pdl)  # Qwen3-30B-A3B decode steps at batch 64-256, Triton PDL on (the default) and off
      for pdl in 1 0; do
        stage moe30_decode_pdl$pdl 120 env TPSERVE_TRITON_PDL=$pdl python3 benchmarks/decode_latency.py --model $a3b \
          --batch-sizes 64,128,256 --contexts 512 --modes graph --out $results/decode_a3b_pdl$pdl.json
      done ;;
    moe_archs)  # other MoE architectures, real configs with random weights (MOE_MODELS: config dirs; Qwen2-MoE's fits an
      # H100): workload A with its roofline, batch-1 decode (bf16, pipelined, 3 rounds) and that step's floor
      for m in ${MOE_MODELS:-tests/data/configs/Qwen1.5-MoE-A2.7B}; do
        name=$(basename $m)
        stage offline_$name 200 python3 benchmarks/offline_throughput.py --model $m --trace --out $results/offline_$name.json
        stage roofline_$name 30 python3 benchmarks/roofline.py $results/offline_$name.json --model $m --peak-tflops 766
        bw=$(python3 -c "import json; print(json.load(open('$results/offline_$name.json'))['copy_bandwidth_Bps'] / 1e12)")
        stage floors_$name 30 python3 benchmarks/roofline.py --model $m --decode-batch 1 --context 512 --peak-tflops 766 \
          --bandwidth-tbps $bw
        stage decode_$name 200 python3 benchmarks/fp8_decode.py --configs $m --fp8-gemms "" --pipelined --rounds 3 \
          --batch-sizes 1 --context 512 --out $results/decode_$name.json
      done ;;
    moe30_decode)
      stage moe30_decode 120 python3 benchmarks/decode_latency.py --model $a3b --batch-sizes 1,64 --contexts 512 --out $results/decode_qwen3_30b_a3b.json
      stage moe30_floors 30 python3 benchmarks/roofline.py --model $a3b --decode-batch 1 64 --context 512 --peak-tflops 766 --bandwidth-tbps 4.26 ;;
    a3b_b1)  # issue 14: Qwen3-30B-A3B batch-1 decode (bf16, pipelined, 3 rounds), the defaults against the add + RMSNorm
      # as kernels of their own (two A3B engines fit)
      stage a3b_b1 300 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --pipelined --rounds 3 --batch-sizes 1 \
        --variant "unfused:TPSERVE_GEMV_FUSE_NORM=0" --out $results/a3b_b1.json ;;
    a3b_variants)  # issue 14: Qwen3-30B-A3B batch-1 decode (bf16, pipelined, 3 rounds), the defaults against engines
      # built with each of A3B_VARIANTS (as ENGINE_VARIANTS), e.g. "unfused:TPSERVE_GEMV_FUSE_NORM=0"; one variant at a
      # time (three A3B engines do not fit in one H200); A3B_BATCHES: other batch sizes, e.g. "1,4,8"
      variant_args=()
      IFS=";" read -ra variants <<< "${A3B_VARIANTS:?}"
      for v in "${variants[@]}"; do variant_args+=(--variant "$v"); done
      stage a3b_variants 300 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --pipelined --rounds 3 \
        --batch-sizes "${A3B_BATCHES:-1}" --context "${A3B_CONTEXT:-512}" "${variant_args[@]}" --out $results/a3b_variants.json ;;
    moe_fp8_tests)  # FP8 experts (an FP8 MoE checkpoint's) in the Triton expert kernels, and a tiny FP8 MoE model
      stage moe_fp8_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe.py tests/gpu/test_fp8_gpu.py -k "fp8 or moe" ;;
    a3b_fp8)  # Qwen3-30B-A3B batch-1 decode, bf16 against the FP8 checkpoint layout (random FP8 weights, experts FP8), 3 rounds
      stage a3b_fp8 400 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --pipelined --rounds 3 \
        --batch-sizes "${A3B_BATCHES:-1}" --context "${A3B_CONTEXT:-512}" --fp8-checkpoint tests/data/configs/Qwen3-30B-A3B-FP8 \
        --out $results/a3b_fp8.json ;;
    a3b_fp8_sweep)  # the FP8 checkpoint layout of Qwen3-30B-A3B at batch 1 against engines built with each of A3B_FP8_VARIANTS
      # (as ENGINE_VARIANTS, e.g. "k512:TPSERVE_MOE_SMALL=gate_up_block_k=512 down_block_k=512"), 3 rounds
      variant_args=()
      IFS=";" read -ra variants <<< "${A3B_FP8_VARIANTS:?}"
      for v in "${variants[@]}"; do variant_args+=(--variant "$v"); done
      stage a3b_fp8_sweep 400 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-30B-A3B-FP8 --fp8-gemms "" \
        --pipelined --rounds 3 --batch-sizes "${A3B_BATCHES:-1}" "${variant_args[@]}" --out $results/a3b_fp8_sweep.json ;;
    norm_b2)  # the add + RMSNorm fused into the GEMVs (and the MoE kernels) at batch 2, against it as a kernel of its own:
      # Qwen3-8B bf16 and Qwen3-30B-A3B, pipelined, 3 alternating rounds (session 19)
      stage norm_b2_8b 150 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms "" --pipelined \
        --rounds 3 --batch-sizes 2 --variant unfused:TPSERVE_GEMV_FUSE_NORM=0 --out $results/norm_b2_8b.json
      stage norm_b2_a3b 150 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --pipelined \
        --rounds 3 --batch-sizes 2 --variant unfused:TPSERVE_GEMV_FUSE_NORM=0 --out $results/norm_b2_a3b.json ;;
    silu_b2)  # the SwiGLU epilogue at batch 2 (SILU_MUL_MAX_TOKENS): kept (session 20: off was bf16 1.023x, FP8 1.0x)
      stage silu_b2 330 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto --pipelined \
        --rounds 3 --batch-sizes 2 --variant silu_off:TPSERVE_GEMV_SILU_MUL=0 --fp8-variant silu_off:TPSERVE_GEMV_SILU_MUL=0 \
        --out $results/silu_b2.json ;;
    fusion_tests)  # the SwiGLU epilogue of the GEMV and the router inside the MoE kernels (session 10)
      stage fusion_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py tests/gpu/test_moe.py \
        tests/gpu/test_fp8_gpu.py -k "silu or rejects or tiny or pdl or model or graph or auto_takes or checkpoint or quantization_fp8_on" ;;
    fusion8)  # Qwen3-8B batch 1, bf16 and FP8, with and without the SwiGLU epilogue; synchronous and pipelined steps
      stage fusion8 330 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto \
        --silu-mul-off --pipelined --rounds 5 --batch-sizes 1 --out $results/fusion8.json ;;
    triton_tests)  # the Triton decode kernel (attention/triton_decode.py) against torch and the decode wrapper, in graphs, in the engine
      stage triton_tests 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_decode_kernels.py -k "not xqa" \
        tests/gpu/test_flashinfer_and_graphs.py ;;
    host_a3b)  # is the A3B batch-1 pipelined step (3.26 ms) host-bound? its interval against its GPU time (pipelined_gpu_ms), 8B beside it
      for model in $a3b tests/data/configs/Qwen3-8B; do
        stage host_$(basename $model) 150 python3 benchmarks/decode_latency.py --model $model --batch-sizes 1 --contexts 512 \
          --modes graph,pipelined --out $results/host_$(basename $model).json
      done ;;
    triton_attn)  # decode attention alone: the Triton kernel's settings vs FlashInfer's decode wrapper
      stage triton_attn 240 python3 benchmarks/experiments/triton_decode_attention.py --heads 32:8,32:4,64:8 \
        --batch-sizes 1,8,32 --contexts 512,4096,16384 --out $results/triton_decode_attention.json ;;
    pdl_tests)  # tpserve's Triton kernels launched with PDL (kernels.triton_pdl): decode attention, rope/KV store, graphs, engines
      stage pdl_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels.py -k "not xqa" \
        tests/gpu/test_fused_kernels.py tests/gpu/test_flashinfer_and_graphs.py ;;
    pdl_engine)  # whole decode steps: each decode kernel with and without PDL in the Triton kernels (A3B: two engines fit)
      stage pdl_engine_8b 240 python3 benchmarks/experiments/triton_attention_engine.py --model tests/data/configs/Qwen3-8B \
        --kernels flashinfer:nopdl,flashinfer,triton:nopdl,triton --rounds 5 --batch-sizes 1,8 --contexts 512,4096 \
        --out $results/pdl_engine_8b.json
      stage pdl_engine_a3b 150 python3 benchmarks/experiments/triton_attention_engine.py --model $a3b \
        --kernels flashinfer:nopdl,triton --rounds 5 --batch-sizes 1 --contexts 512,4096 --out $results/pdl_engine_a3b.json ;;
    norm_tests)  # tpserve's add + RMSNorm (PDL) against FlashInfer's, the engines on it; auto's Triton/wrapper split
      stage norm_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels.py tests/gpu/test_fused_kernels.py \
        tests/gpu/test_flashinfer_and_graphs.py tests/gpu/test_overlap.py tests/gpu/test_moe.py -k "not xqa and not auto_picks" ;;
    norm_engine)  # whole steps: tpserve's add + RMSNorm vs FlashInfer's; A3B: session 11's defaults vs today's
      stage norm_engine_8b 150 python3 benchmarks/experiments/triton_attention_engine.py --model tests/data/configs/Qwen3-8B \
        --kernels triton:finorm,triton --rounds 5 --batch-sizes 1,8 --contexts 512,4096 --out $results/norm_engine_8b.json
      stage norm_engine_a3b 150 python3 benchmarks/experiments/triton_attention_engine.py --model $a3b \
        --kernels flashinfer:finorm:nopdl,triton --rounds 5 --batch-sizes 1 --contexts 512,4096 --out $results/norm_engine_a3b.json ;;
    auto_tests) stage auto_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels.py -k auto ;;
    spec_long)  # n-gram drafts at a long context (8,000-token prompts; every draft right once the text cycles): drafted
      # steps as one-token rows in the decode graph (each row reads its sequence's KV pages) against plain decoding and
      # against drafted steps run eagerly as chunks (--chunked: one read a sequence); session 54 call1/ (H100)
      stage spec_long 300 python3 benchmarks/spec_decode.py --config tests/data/configs/Qwen3-8B --scale 0 --vocab-size 4096 \
        --prompt-tokens 8000 --tokens 128 --batch-sizes 1,8 --chunked --out $results/spec_long.json ;;
    fp8_ratio8)  # issue 16's ratio at Qwen3-8B batch 1 with today's defaults (carry fp8_blockscale_gemm_90 and the bf16 sm90 prefill)
      stage fp8_ratio8 250 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto --pipelined \
        --rounds 5 --batch-sizes 1 --out $results/fp8_ratio8.json ;;
    moe_pdl)  # issue 14: the MoE decode kernels (router top-k, experts gate_up and down) with PDL; tests, then A3B steps with and without
      stage moe_pdl_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe.py
      stage moe_pdl 150 python3 benchmarks/experiments/triton_attention_engine.py --model $a3b --kernels triton:nopdl,triton \
        --rounds 5 --batch-sizes 1 --contexts 512,4096 --out $results/moe_pdl.json ;;
    fp8_loads)  # issue 16: does the FP8 GEMV gain from prefetching more of its weight while the kernel before it runs
      # (PDL)? One token's FP8 GEMV prefetches half an o/qkv/gate_up weight row by default (bf16's: all of it)
      # Carry the variants' modules (build_flashinfer_aot.sh gemv:FP8_LOADS=16 ...) and fp8_blockscale_gemm_90.
      stage fp8_loads 420 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto --pipelined \
        --rounds 5 --batch-sizes 1 --fp8-variant "loads16:TPSERVE_GEMV_DEFINES=FP8_LOADS=16" \
        --fp8-variant "rows4u2:TPSERVE_GEMV_DEFINES=FP8_ROWS=4 FP8_LOADS=8" \
        --fp8-variant "rows4u4:TPSERVE_GEMV_DEFINES=FP8_ROWS=4 FP8_LOADS=16" --out $results/fp8_loads.json ;;
    attn_sweep)  # the batch-1 Triton decode kernel's settings in whole steps (session 11 tuned them alone,
      # L2 cold; in the graph it runs beside the o GEMV's weight prefetch), Qwen3-8B (32:8 heads): five 16 GB engines
      stage attn_sweep 200 python3 benchmarks/experiments/triton_attention_engine.py \
        --model tests/data/configs/Qwen3-8B --kernels triton,triton:prefetch=0,\
triton:chunk=16,triton:chunk=64,triton:num_warps=2 \
        --rounds 3 --batch-sizes 1 --contexts 512,4096 --out $results/attn_sweep.json ;;
    attn_setting)  # a decode setting (TRITON_DECODE_SETTING, default prefetch=0: before session 14) in issue 16's
      # ratio, Qwen3-8B FP8 / bf16 at batch 1 (for Qwen3-30B-A3B: attn_a3b with A3B_SETTINGS)
      setting=${TRITON_DECODE_SETTING:-prefetch=0}
      stage attn_setting_fp8 250 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B \
        --fp8-gemms auto --pipelined --rounds 5 --batch-sizes 1 --variant "setting:TPSERVE_TRITON_DECODE=$setting" \
        --fp8-variant "setting:TPSERVE_TRITON_DECODE=$setting" --out $results/attn_setting_fp8.json ;;
    attn_a3b)  # Qwen3-30B-A3B (32:4 heads: half the programs of 8B's 32:8) against each Triton decode setting in
      # A3B_SETTINGS (';'-separated), two 61 GB engines a stage. Session 14: chunk=16 (with merge_unroll=32) 1.04-1.05x
      IFS=';' read -ra a3b_settings <<< "${A3B_SETTINGS:-chunk=16;chunk=16 merge_unroll=32}"
      for setting in "${a3b_settings[@]}"; do
        tag=$(echo "$setting" | tr ' =' '_-')  # a file name the device tool returns (no '=')
        stage "attn_a3b_$tag" 150 python3 benchmarks/experiments/triton_attention_engine.py --model $a3b \
          --kernels "triton,triton:${setting// /:}" --rounds 3 --batch-sizes 1 --contexts 512,4096 \
          --out "$results/attn_a3b_$tag.json"
      done ;;
    attn_big)  # where auto's Triton decode hands over to the decode wrapper: whole steps at batch 32-128
      stage attn_big 200 python3 benchmarks/experiments/triton_attention_engine.py --model tests/data/configs/Qwen3-8B \
        --kernels flashinfer,triton --rounds 3 --batch-sizes 32,64,128 --contexts 512,2048 --out $results/attn_big.json ;;
    fp8_attention)  # issue 16's ratio, Qwen3-8B batch 1, with each decode attention in both engines
      for kernel in auto triton; do
        stage fp8_attention_$kernel 150 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B \
          --fp8-gemms auto --pipelined --rounds 5 --batch-sizes 1 --decode-attention $kernel --out $results/fp8_attention_$kernel.json
      done ;;
    triton_engine)  # whole decode steps, --decode-attention flashinfer vs triton, Qwen3-8B and Qwen3-30B-A3B
      stage triton_engine_8b 200 python3 benchmarks/experiments/triton_attention_engine.py \
        --model tests/data/configs/Qwen3-8B --batch-sizes 1,8 --contexts 512,4096 --out $results/triton_engine_8b.json
      stage triton_engine_a3b 240 python3 benchmarks/experiments/triton_attention_engine.py --model $a3b \
        --batch-sizes 1 --contexts 512,4096 --out $results/triton_engine_a3b.json ;;  # batch 1: two A3B engines fit
    fp8_rounds_piped)  # issue 16's ratio, Qwen3-8B and 32B: both engines held, 5 rounds, synchronous and pipelined steps
      stage fp8_rounds_piped 320 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B \
        --fp8-gemms auto --pipelined --rounds 5 --batch-sizes 1 --out $results/fp8_rounds_piped.json ;;
    fuse_norm)  # issue 16's ratio, Qwen3-8B batch 1: the add + RMSNorm in the GEMVs (TPSERVE_GEMV_FUSE_NORM=1)
      # against its own kernel (the default) in both engines
      stage fuse_norm 300 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto \
        --pipelined --rounds 3 --batch-sizes 1 --variant "fused:TPSERVE_GEMV_FUSE_NORM=1" \
        --fp8-variant "fused:TPSERVE_GEMV_FUSE_NORM=1" --out $results/fuse_norm.json ;;
    fuse_check)  # the fused add + RMSNorm on a tiny model: graphs, PDL and GEMV variants against separate kernels
      stage fuse_check 240 python3 benchmarks/experiments/fused_norm_check.py ;;
    engine_variants8)  # issue 16, Qwen3-8B batch 1: engines built with each of ENGINE_VARIANTS (';'-separated
      # LABEL:ENV=VALUE[,ENV=VALUE], e.g. "early:TPSERVE_GEMV_DEFINES=EARLY_TRIGGER=1;unfused:TPSERVE_GEMV_FUSE_NORM=0")
      # against the defaults, bf16 and FP8, 5 alternating rounds
      variant_args=()
      IFS=';' read -ra variants <<< "${ENGINE_VARIANTS:?}"
      for v in "${variants[@]}"; do  # FP8_ONLY=1: FP8 engines only (a variant of the FP8 kernels)
        [ "${FP8_ONLY:-0}" = 1 ] || variant_args+=(--variant "$v")
        variant_args+=(--fp8-variant "$v")
      done
      stage engine_variants8 420 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto \
        --pipelined --rounds 5 --batch-sizes 1 --context "${CONTEXT8:-512}" "${variant_args[@]}" --out $results/engine_variants8.json ;;
    gemv_variants8)  # issue 16, Qwen3-8B batch 1: the GEMV built with GEMV_VARIANT (TPSERVE_GEMV_DEFINES, e.g. FP8_ROWS=4)
      # against the default, bf16 and FP8, 5 alternating rounds. Session 16's x_load1-3 were X_LOAD variants (removed)
      stage gemv_variants8 330 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto \
        --pipelined --rounds 5 --batch-sizes 1 --variant "variant:TPSERVE_GEMV_DEFINES=${GEMV_VARIANT:?}" \
        --fp8-variant "variant:TPSERVE_GEMV_DEFINES=$GEMV_VARIANT" --out $results/gemv_variants8.json ;;
    quick_checks)  # a short check of the final code: the GEMV's outlier, chain and tiny-model tests, the MoE small-batch and graph tests
      stage quick_checks 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py tests/gpu/test_moe.py \
        -k "outlier or tiny_model or chain or small_batch or graph" ;;
    gemv_err_variant)  # issue 16's GEMM accuracy check: Qwen3-8B's linears at one token, the default FP8 GEMV and GEMV_VARIANT
      # (one, e.g. FP8_ROWS=4), relative error against the float64 product of the unquantized weights, and times
      stage gemv_err_variant 150 python3 benchmarks/experiments/fp8_gemm.py --configs tests/data/configs/Qwen3-8B --ms 1 \
        --variants "bf16,cuda,cuda:${GEMV_VARIANT//,/:}" --out $results/gemv_err_variant.json ;;
    gemv_tests_variant)  # test_gemv.py (GEMV_TESTS_K: its -k, default the tiny models and chains) on each of GEMV_VARIANT
      # (';'-separated TPSERVE_GEMV_DEFINES, e.g. "FP8_LOADS=16;FP8_ROWS=4")
      IFS=';' read -ra variants <<< "${GEMV_VARIANT:?}"
      for v in "${variants[@]}"; do
        stage "gemv_tests_variant $v" 200 env TPSERVE_GEMV_DEFINES="$v" python3 -m pytest -q -p no:cacheprovider \
          tests/gpu/test_gemv.py -k "${GEMV_TESTS_K:-tiny_model or chain}"
      done ;;
    fp8_dynamic)  # issue 16: llm-compressor's FP8_DYNAMIC layout (a scale per channel: RedHatAI's -FP8-dynamic checkpoints)
      # against bf16 and Qwen's 128 x 128 blocks, decode at batch 1 and 32 (Triton decode attention: no FlashInfer decode
      # module to carry): Qwen3-8B (its linears in Triton's W8A8 GEMM) and Qwen3-30B-A3B (experts FP8, a scale a row)
      stage fp8_dynamic8 200 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B --fp8-gemms auto \
        --fp8-checkpoint tests/data/configs/Qwen3-8B-FP8-dynamic --pipelined --batch-sizes 1,32 --out $results/fp8_dynamic8.json
      stage fp8_dynamic_a3b 300 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --fp8-checkpoint ${a3b}-FP8 \
        --fp8-checkpoint ${a3b}-FP8-dynamic --pipelined --batch-sizes 1,32 --out $results/fp8_dynamic_a3b.json ;;
    a3b_quant)  # issue 16: --quantization fp8 on Qwen3-30B-A3B (its experts quantized at load since session 45) against bf16
      # and Qwen's FP8 checkpoint layout, decode at batch 1 and 32
      stage a3b_quant 450 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms auto --fp8-checkpoint ${a3b}-FP8 \
        --pipelined --batch-sizes 1,32 --out $results/a3b_quant.json ;;
    fp8_rowwise)  # issue 16: the row-scaled FP8 GEMMs (RedHatAI's -FP8-dynamic layout) at decode batch sizes, Qwen3-8B's linears:
      # Triton's block GEMM (before session 45), fp8_gemm_rowwise and ROWWISE_VARIANTS (its tiles), torch._scaled_mm
      stage fp8_rowwise 300 python3 benchmarks/experiments/fp8_rowwise_gemm.py --configs tests/data/configs/Qwen3-8B \
        --ms "${ROWWISE_MS:-1,2,8,16,32,64,128}" --variants "w8a8,rowwise,${ROWWISE_VARIANTS:+$ROWWISE_VARIANTS,}scaled_mm,cuda" \
        --out $results/fp8_rowwise.json ;;
    moe_fp8_tiles)  # issue 16: the grouped GEMM's tiles on FP8 experts (Qwen3-30B-A3B-FP8's layout): the FP8 table against
      # the unquantized experts' (session 44's K_UNIFORM scale loads may let them fit and win), decode to prefill sizes
      stage moe_fp8_tiles 240 python3 benchmarks/experiments/moe_tiles.py --sweep tables --fp8 --out $results/moe_fp8_tiles.json ;;
    fp8_ratio32)  # issue 16's ratio at Qwen3-32B batch 1 with today's defaults, 3 alternating rounds
      stage fp8_ratio32 300 python3 benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-32B --fp8-gemms auto \
        --pipelined --rounds 3 --batch-sizes 1 --out $results/fp8_ratio32.json ;;
    engine_tests)  # the GEMV, CUDA graphs, overlap scheduling, sampling and grammar masks on the GPU
      stage engine_tests 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv.py tests/gpu/test_overlap.py \
        tests/gpu/test_flashinfer_and_graphs.py tests/gpu/test_structured.py tests/gpu/test_fused_kernels.py \
        tests/gpu/test_fp8_gpu.py ;;
    a3b_kernels)  # Qwen3-30B-A3B batch 1: each kernel in the graph, bf16 and the FP8 checkpoint layout, with A3B_KERNEL_ENV (e.g.
      # "TPSERVE_MOE_GEMV=1") and without
      for m in ${A3B_KERNEL_MODELS:-$a3b tests/data/configs/Qwen3-30B-A3B-FP8}; do
        for e in "" "${A3B_KERNEL_ENV:-}"; do
          stage a3b_kernels 150 env $e python3 benchmarks/experiments/step_timeline.py --model $m --in-graph --iters 10 \
            --out $results/a3b_kernels_$(basename $m)_${e//[^A-Za-z0-9]/_}.json
        done
      done ;;
    step_timeline)  # Qwen3-8B batch 1: the GPU's work and idle time outside the CUDA graph in a pipelined step
      for quant in bf16 fp8; do
        stage step_timeline_$quant 150 python3 benchmarks/experiments/step_timeline.py --model tests/data/configs/Qwen3-8B \
          $([ $quant = fp8 ] && echo --quantization fp8) --out $results/step_timeline_$quant.json
      done ;;
    graph_profile_8b_fused)  # graph_profile_8b_fp8 with the add + RMSNorm in the GEMVs
      stage graph_profile_8b_fp8_fused 150 env TPSERVE_GEMV_FUSE_NORM=1 python3 benchmarks/profile_decode.py \
        --model tests/data/configs/Qwen3-8B --quantization fp8 --batch-sizes 1 --graph-only \
        --out $results/graph_profile_8b_fp8_fused.json ;;
    graph_profile_8b)  # graph_profile's Qwen3-8B bf16 and FP8 halves
      stage graph_profile_8b 120 python3 benchmarks/profile_decode.py --model tests/data/configs/Qwen3-8B --batch-sizes 1 \
        --graph-only --out $results/graph_profile_8b.json
      stage graph_profile_8b_fp8 150 python3 benchmarks/profile_decode.py --model tests/data/configs/Qwen3-8B --quantization fp8 \
        --batch-sizes 1 --graph-only --out $results/graph_profile_8b_fp8.json ;;
    split_profile)  # not yet run: why 16 splits speed A3B's step (0.953x) and slow Qwen3-8B's (1.014x) at batch 1 (session 20):
      # both graphs kernel by kernel at 16 and at 32 splits (TPSERVE_TRITON_DECODE), to compare the attention kernel's time
      for splits in 16 32; do
        stage split_profile_a3b_$splits 100 env TPSERVE_TRITON_DECODE=max_splits=$splits python3 benchmarks/profile_decode.py \
          --model $a3b --batch-sizes 1 --graph-only --out $results/split_profile_a3b_$splits.json
        stage split_profile_8b_$splits 100 env TPSERVE_TRITON_DECODE=max_splits=$splits python3 benchmarks/profile_decode.py \
          --model tests/data/configs/Qwen3-8B --batch-sizes 1 --graph-only --out $results/split_profile_8b_$splits.json
      done ;;
    graph_profile_a3b)  # Qwen3-30B-A3B batch 1, kernel by kernel inside the CUDA graph
      stage graph_profile_a3b 100 python3 benchmarks/profile_decode.py --model $a3b --batch-sizes 1 --graph-only \
        --out $results/graph_profile_a3b.json ;;
    graph_profile)  # batch-1 decode, kernel by kernel inside the CUDA graph: Qwen3-30B-A3B, Qwen3-8B bf16 and FP8
      stage graph_profile_a3b 150 python3 benchmarks/profile_decode.py --model $a3b --batch-sizes 1 --graph-only \
        --out $results/graph_profile_a3b.json
      stage graph_profile_8b 120 python3 benchmarks/profile_decode.py --model tests/data/configs/Qwen3-8B --batch-sizes 1 \
        --graph-only --out $results/graph_profile_8b.json
      stage graph_profile_8b_fp8 150 python3 benchmarks/profile_decode.py --model tests/data/configs/Qwen3-8B --quantization fp8 \
        --batch-sizes 1 --graph-only --out $results/graph_profile_8b_fp8.json ;;
    moe_small)  # the small-batch MoE kernels against the grouped GEMMs, one layer's experts, and their config sweep
      stage moe_small 420 python3 benchmarks/experiments/moe_small_batch.py --model $a3b --out $results/moe_small_batch.json ;;
    moe_small_quick) stage moe_small_quick 200 python3 benchmarks/experiments/moe_small_batch.py --model $a3b \
      --sweep-batch-sizes 1 --out $results/moe_small_batch.json ;;
    moe_small_paths)  # where the small-batch kernels and the grouped GEMMs cross (SMALL_BATCH_MAX_ROWS), no sweep
      stage moe_small_paths 200 python3 benchmarks/experiments/moe_small_batch.py --model $a3b --batch-sizes 2,4,8,9,16 \
        --sweep-batch-sizes "" --out $results/moe_small_paths.json ;;
    moe_small_tp2)  # the same on a TP 2 rank's slice (expert intermediate 384), one GPU
      stage moe_small_tp2 300 python3 benchmarks/experiments/moe_small_batch.py --model $a3b --tp 2 --batch-sizes 1,4,16 \
        --sweep-batch-sizes 1,4 --out $results/moe_small_batch_tp2.json ;;
    moe_align)  # the MoE sort by expert at decode sizes: many programs against the one-program kernel (session 32)
      stage moe_align 150 python3 benchmarks/experiments/moe_align.py --out $results/moe_align.json ;;
    moe_tiles) stage moe_tiles 240 python3 benchmarks/experiments/moe_tiles.py ${MOE_TILES_ARGS:-} --out $results/moe_tiles.json ;;
    moe30_tp2) stage moe30_tp2 240 python3 benchmarks/offline_throughput.py --model $a3b --tp-size 2 --out $results/offline_qwen3_30b_a3b_tp2.json ;;
    moe30_tp2_ep)  # the same with whole experts per rank (--expert-parallel), to set beside moe30_tp2
      stage moe30_tp2_ep 240 python3 benchmarks/offline_throughput.py --model $a3b --tp-size 2 --expert-parallel \
        --out $results/offline_qwen3_30b_a3b_tp2_ep.json ;;
    # FP8 (issue 16), two calls: "fp8_gemm fp8_decode8" and "fp8_tests fp8_decode32"
    fp8_profile8)  # where the FP8 decode step's time goes (weights, then weights + KV in FP8)
      stage fp8_profile8 120 python3 benchmarks/profile_decode.py --model $large --quantization fp8 --batch-sizes 1,64 \
        --out $results/profile_qwen3_8b_fp8.json
      stage fp8_profile8_kv 120 python3 benchmarks/profile_decode.py --model $large --quantization fp8 \
        --kv-cache-dtype fp8_e4m3 --batch-sizes 1 --out $results/profile_qwen3_8b_fp8_kv.json ;;
    fp8_serving32)  # Qwen3-32B with FP8 weights at TP 1 on one GPU, through HTTP (OpenAI chat streaming)
      srv=$(serving_dir .models/Qwen3-32B /tmp/qwen3-32b)
      stage fp8_serving32 300 python3 benchmarks/serving.py --launch $srv --server-args "--quantization fp8" \
        --rates inf,4 --num-requests 128,32 --server-log $out/server_fp8_32b.log --out $results/serving_qwen3_32b_fp8.json ;;
    fp8kv_fused)  # the fused norm/rotary/store kernel into FP8 pages: its test, then the FP8-KV step's kernels
      stage fp8kv_fused_test 150 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_fused_kernels.py -k norm_rope_store
      stage fp8kv_fused_profile 120 python3 benchmarks/profile_decode.py --model $large --quantization fp8 \
        --kv-cache-dtype fp8_e4m3 --batch-sizes 1,64 --out $results/profile_qwen3_8b_fp8_kv_fused.json ;;
    fp8_kv_test) stage fp8_kv_test 150 python3 -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_fp8_gpu.py -k kv_cache ;;
    fp8_offline8)  # workload A with FP8 weights (then FP8 weights and KV) against bf16, in one call. FlashInfer's FP8
      # GEMM compiles a kernel per shape class on first use (DeepGEMM's JIT, cached in TRTLLM_DG_CACHE_DIR): fp8_cold
      # is the first FP8 run, the figures are the runs after it
      for q in fp8_cold bf16 fp8 fp8kv; do
        case $q in bf16) qa="";; fp8kv) qa="--quantization fp8 --kv-cache-dtype fp8_e4m3";; fp8*) qa="--quantization fp8";; esac
        stage fp8_offline8_$q 150 python3 benchmarks/offline_throughput.py --model $large $qa --out $results/offline_qwen3_8b_$q.json
      done ;;
    fp8_offline8_cold)  # FP8 workload A on a fresh DeepGEMM cache (the first launch on a machine), then again
      rm -rf /tmp/deepgemm-fresh
      for q in cold warm; do
        stage fp8_offline8_$q 200 env TRTLLM_DG_CACHE_DIR=/tmp/deepgemm-fresh python3 benchmarks/offline_throughput.py \
          --model $large --quantization fp8 --out $results/offline_qwen3_8b_fp8_$q.json
      done ;;
    offline06_fp8kv) stage offline06_fp8kv 150 python3 benchmarks/offline_throughput.py --model $small --kv-cache-dtype fp8_e4m3 \
      --out $results/offline_qwen3_0.6b_fp8kv.json ;;
    fp8_tests) stage fp8_tests 400 python3 -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_fp8_gpu.py ;;
    fp8_gemm_few) stage fp8_gemm_few 90 python3 benchmarks/experiments/fp8_gemm.py --configs $large --ms 1,2,4 \
      --variants cuda,w8a8,flashinfer --out $results/fp8_gemm_few.json ;;
    fp8_gemm) stage fp8_gemm 270 python3 benchmarks/experiments/fp8_gemm.py --configs $large --out $results/fp8_gemm.json ;;
    fp8_decode8) stage fp8_decode8 300 python3 benchmarks/fp8_decode.py --configs $large --fp8-gemms auto,cuda_triton,flashinfer \
      --batch-sizes 1,64 --out $results/fp8_decode_8b.json ;;
    fp8_decode8_auto) stage fp8_decode8_auto 180 python3 benchmarks/fp8_decode.py --configs $large --fp8-gemms auto,flashinfer \
      --bf16-cublas --batch-sizes 1,64 --out $results/fp8_decode_8b_auto.json ;;
    fp8_decode32) stage fp8_decode32 220 python3 benchmarks/fp8_decode.py --configs .models/Qwen3-32B --fp8-gemms auto \
      --bf16-cublas --batch-sizes 1 --out $results/fp8_decode_32b.json ;;
    fp8_decode_pdl)  # issue 16's ratio at batch 1, Qwen3-8B and Qwen3-32B, with the GEMV launched with PDL and without
      stage fp8_decode_pdl 300 python3 benchmarks/fp8_decode.py --configs $large,.models/Qwen3-32B --fp8-gemms auto \
        --bf16-cublas --gemv-pdl-off --batch-sizes 1 --out $results/fp8_decode_pdl.json ;;
    fp8_decode_rounds)  # the same ratio with the bf16 and FP8 engines held at once and timed in turn, 7 rounds
      stage fp8_decode_rounds 300 python3 benchmarks/fp8_decode.py --configs $large,.models/Qwen3-32B --fp8-gemms auto \
        --rounds 7 --batch-sizes 1 --out $results/fp8_decode_rounds.json ;;
    moe30_gemv)  # issue 14: the bf16 CUDA GEMV for the dense layers at one row against cuBLAS (TPSERVE_BF16_GEMV=0)
      stage moe30_gemv 150 python3 benchmarks/fp8_decode.py --configs $a3b --fp8-gemms "" --bf16-cublas \
        --batch-sizes 1,64 --out $results/decode_qwen3_30b_a3b_gemv.json ;;
    structured)  # issue 12: 64 json_schema requests against 64 unconstrained (the real tokenizer: xgrammar's vocabulary)
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      stage structured 150 python3 benchmarks/structured_output.py --model $srv --repeats 2 --out $results/structured.json ;;
    structured_si200)  # the same at a 0.2 ms GIL switch interval (Python's default: 5 ms)
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      stage structured_si200 150 python3 benchmarks/structured_output.py --model $srv --repeats 2 \
        --switch-interval-us 200 --out $results/structured_si200.json ;;
    structured_tests) stage structured_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured.py ;;
    structured_inline)  # the same with the mask jobs on the main thread (no mask worker), for comparison
      srv=$(serving_dir $small /tmp/qwen3-0.6b)
      stage structured_inline 150 python3 benchmarks/structured_output.py --model $srv --repeats 2 --inline-masks \
        --out $results/structured_inline.json
      stage structured_host 200 python3 benchmarks/structured_host.py --tokenizer $srv --out $results/structured_host.json ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
  esac
done
pack_jit_modules
echo "=== summary" | tee -a "$log"
tar czf "$out/results.tgz" -C "$results" .  # one file: the tool brings back at most 8
python3 scripts/summarize.py "$results" /tmp/tpserve-results.json 2>&1 | tee -a "$log"
