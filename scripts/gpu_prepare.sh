#!/usr/bin/env bash
# What a GPU call carries, built on this (CPU) machine once per checkout, into ./.gpu (ignored by
# git: add /.gpu/ to .git/info/exclude): the wheels the GPU machine lacks (.whl), the real configs
# and tokenizer of the benchmarked models (.models) and FlashInfer's norm/rotary/SiLU modules
# prebuilt for sm_90a (.fiaot, scripts/build_flashinfer_aot.sh). Needs the project's venv (.venv)
# and ../shared (wheels.sh, models). About 5 minutes on 2 cores. Then a call, from the repo root:
#
#   run(command="rm -rf .whl .models .fiaot && mv .gpu/.whl .whl && mv .gpu/.models .models \
#        && mv .gpu/.fiaot .fiaot && mkdir -p .ficache && timeout 540 bash scripts/gpu_suite.sh \$OUT <stages> \
#        > /dev/null 2>&1; grep '^=== ' \$OUT/suite.log", carry=[".gpu"])
#
# and, when the call returns jit_aot.tgz: tar xzf <it> -C .gpu/.fiaot (the JIT modules it built,
# loaded with no build next time). The tree and what it carries must stay under 64 MiB (67.1 MB):
# the tree ~6.3 MB, .whl 43.6, .models 1.3 and this script's .fiaot 2.8 leave ~13 MB of modules.
# One model shape's whole set is 22 MB, so carry the ones the stages need (session 8 carried the
# bf16 decode, the FA2 and sm90 bf16 prefill and the FP8-KV decode modules: 12.6 MB); XQA's
# modules build in ~10 s each and need not travel. scripts/gpu_carry.sh picks them by name from
# .gpu/jit into .gpux and checks the size.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/.models
bash ../shared/gpu/wheels.sh "xgrammar==0.2.9" prometheus-client jsonschema jsonschema-specifications referencing \
  rpds-py attrs psutil jinja2 markupsafe
rm -f .whl/openai*.whl  # the client side only: the GPU machine does not need it
for m in Qwen3-0.6B Qwen3-8B Qwen3-14B Qwen3-32B Qwen3-30B-A3B; do cp -r "../shared/models/configs/$m" .gpu/.models/; done
tar cJf .gpu/.models/qwen3-tokenizer.tar.xz -C ../shared/models qwen3-tokenizer
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/build_flashinfer_aot.sh
rm -rf .gpu/.whl .gpu/.fiaot && mv .whl .gpu/.whl && mv .fiaot .gpu/.fiaot
du -sh .gpu/.whl .gpu/.models .gpu/.fiaot
