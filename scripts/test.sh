#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs the Python clients used by the API tests,
# builds, pulls the four catalog models (checked against pinned sha256; cached after the first
# run), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import openai' 2>/dev/null; then
    echo "== installing the openai Python package (for the API compatibility test)"
    python3 -m pip install --quiet --disable-pip-version-check 'openai>=1.55.3,<3'
fi
if ! python3 -c 'import anthropic' 2>/dev/null; then
    echo "== installing the anthropic Python package (for the Messages API compatibility test)"
    python3 -m pip install --quiet --disable-pip-version-check 'anthropic>=0.40,<3'
fi

echo "== building"
cargo build --release --workspace --all-targets

echo "== pulling the test models"
for m in smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct gemma-3-270m; do
    ./target/release/specula pull "$m"
done

echo "== testing"
cargo test --release --workspace -- --test-threads 1 "$@"

echo "== checking the CUDA backend's host code (SPECULA_CUDA_STUB=1: no nvcc, no GPU; docs/gpu.md)"
SPECULA_CUDA_STUB=1 cargo check --release -p specula --features cuda
