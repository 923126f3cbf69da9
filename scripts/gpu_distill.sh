#!/bin/bash
# `specula distill` on the GPU machine (docs/gpu.md, "Training drafters on the GPU"): the target's
# answers decoded on the GPU engine, the teacher pass on the GPU, training on candle's CUDA
# backend. Stages are cached in OUTDIR and training checkpoints, so the same command run again
# (in a later call on the same warm machine) resumes where the last one stopped.
# usage: scripts/gpu_distill.sh BINARY_XZ MODEL OUTDIR [distill options...]
#   BINARY_XZ: the stripped, xz-compressed `specula` built with --features cuda-train
#   MODEL:     the target (a GGUF file or HF bundle directory on the device)
#   OUTDIR:    distill's --out (the head, its caches and checkpoints)
set -uo pipefail
BIN_XZ=${1:?binary}; MODEL=${2:?model}; DEST=${3:?outdir}; shift 3
# candle's CUDA build links cuBLAS, cuRAND and NVRTC (PyTorch's wheels hold them there) and
# the driver library.
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
BIN=/tmp/specula-cuda-train
if [ ! -x "$BIN" ] || [ "$BIN_XZ" -nt "$BIN" ]; then
  xz -d -c "$BIN_XZ" > "$BIN" && chmod +x "$BIN" || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
mkdir -p "$DEST"
exec "$BIN" distill --target "$MODEL" --device cuda:0 --out "$DEST" "$@"
