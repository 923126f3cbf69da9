#!/bin/bash
# Side-by-side GEMM variants in one device call: `specula bench --device cuda:0` once per value of
# an environment variable (same binary, alternated over ROUNDS), one summary line each
# (scripts/gpu_variants.sh runs them).
# usage: scripts/gpu_gemm_ab.sh BINARY_XZ OUTDIR SHAPE VAR VALUE[,VALUE...] [ROUNDS]
#   e.g. scripts/gpu_gemm_ab.sh .gpu/specula.xz $OUT qwen3-8b SPECULA_CUDA_GEMM_PIPE 0,1,2
set -uo pipefail
BIN_XZ=${1:?binary}; OUTDIR=${2:?outdir}; SHAPE=${3:?shape}; VAR=${4:?variable}; VALUES=${5:?values}; ROUNDS=${6:-1}
variants=()
for i in $(seq "$ROUNDS"); do
  for v in ${VALUES//,/ }; do variants+=("$v-$i:$VAR=$v"); done
done
exec "$(dirname "$0")/gpu_variants.sh" "$BIN_XZ" "$OUTDIR" "$SHAPE" "${variants[@]}"
