#!/usr/bin/env bash
# Assemble what one GPU call carries into ./.gpux, under the device tool's 64 MiB limit (tree included):
#   bash scripts/gpu_carry.sh [--models] PATTERN...
# .gpu/.whl and .gpu/.fiaot (scripts/gpu_prepare.sh) always; .gpu/.models with --models; and the
# FlashInfer JIT modules in .gpu/jit whose names match a PATTERN (grep -E), e.g. 'decode.*kv_bf16'
# 'prefill.*bf16.*sm90' tpserve_gemv. Keep .gpu/jit filled with each call's output:
# tar xzf jit_aot.tgz -C .gpu/jit. The matched modules travel as one xz tarball, .gpux/jit.txz (about a fifth of
# their size: 15 modules of 50 MB pack to 10.5 MB). Then run(carry=[".gpux"], command="rm -rf .whl .models .fiaot &&
# mv .gpux/.whl .whl && mv .gpux/.fiaot .fiaot && tar xJf .gpux/jit.txz -C .fiaot && { mv .gpux/.models .models || true; } && ...").
set -euo pipefail
cd "$(dirname "$0")/.."
models=0
if [ "${1:-}" = "--models" ]; then models=1; shift; fi
rm -rf .gpux && mkdir -p .gpux && cp -r .gpu/.whl .gpu/.fiaot .gpux/
[ $models = 1 ] && cp -r .gpu/.models .gpux/
modules=()
for pattern in "$@"; do
  found=$(ls .gpu/jit | grep -E -- "$pattern" || true)
  [ -n "$found" ] || { echo "no module in .gpu/jit matches $pattern" >&2; exit 1; }
  for m in $found; do modules+=("$m"); echo "carry $m"; done
done
tar cJf .gpux/jit.txz -C .gpu/jit ${modules[@]+"${modules[@]}"}
limit=67108864
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s}')
carry=$(du -sb .gpux | cut -f1)
echo "tree $tree + carry $carry = $((tree + carry)) bytes of $limit"
[ $((tree + carry)) -le $limit ] || { echo "over the limit: carry fewer modules" >&2; exit 1; }
