#!/bin/bash
# session 22, call 4: the final default build, PyTorch in the same call, llama-3.1-8b, q8_0
S=scripts/gpu_variants.sh
F='profile 64 rows \((s|2x8/p[0-9wpx]|2x8/pauto/narrow)'
$S .gpu/specula.xz $OUT qwen3-8b final 2>&1 | grep -Ev "$F"
timeout 300 python3 scripts/gpu_torch_baseline.py --shape qwen3-8b --batches 1,64 --json $OUT/torch-qwen3-8b.json 2>&1 | grep -v Warning | tail -6
$S .gpu/specula.xz /tmp/r qwen3-8b final2 2>&1 | grep -Ev "$F|profile 1 rows"
$S .gpu/specula-s21.xz /tmp/r qwen3-8b s21 2>&1 | grep -Ev "$F|profile 1 rows"
$S .gpu/specula.xz $OUT llama-3.1-8b final 2>&1 | grep -Ev "$F|profile"
SPECULA_BENCH_ARGS="--dtype q8_0" $S .gpu/specula.xz $OUT qwen3-8b q8 2>&1 | grep -Ev "$F|profile"
