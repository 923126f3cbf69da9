#!/bin/bash
# The serving engine on the GPU (`--device cuda:0`) against the same engine on the CPU, on a real
# model, in one device call: exactness gate (n-gram = AR, batched = solo), GPU vs CPU outputs,
# and a concurrency sweep. docs/gpu.md says how the model gets onto the device.
# usage: scripts/gpu_engine.sh BINARY_XZ MODEL OUTDIR [LEVELS]
#   BINARY_XZ: the stripped, xz-compressed `specula` built with --features cuda
#   MODEL:     a GGUF file or HF bundle directory on the device
#   OUTDIR:    gpu_engine.tgz (gate-cpu.json, gate-gpu.json, sweep-*.txt, logs) and engine-*.json
set -uo pipefail
BIN_XZ=${1:?binary}; MODEL=${2:?model}; DEST=${3:?outdir}; LEVELS=${4:-1,4,16,32}
# Everything is written to a work folder and comes back as one archive (the device returns a
# limited number of files), plus the engine receipts.
OUTDIR=$(mktemp -d /tmp/gpu_engine.XXXX)
mkdir -p "$DEST"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
BIN=/tmp/specula-cuda
xz -d -c "$BIN_XZ" > "$BIN" && chmod +x "$BIN" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUTDIR/nvidia-smi.txt"
GPU=${GPU_DEVICE:-cuda:0}  # GPU_DEVICE=cpu runs the whole script on the CPU (a dry run)
GATE_ARGS=${GATE_ARGS:-}     # e.g. "--prompts FILE" for a shorter prompt set
rc=0
serve() { # DEVICE PORT LOG [ARGS...]
  local dev=$1 port=$2 log=$3; shift 3
  "$BIN" serve "$MODEL" --device "$dev" --port "$port" --max-batch 64 --max-queue 512 "$@" > "$log" 2>&1 &
  echo $!
}
PROMPT="Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."
for spec in off ngram; do
  "$BIN" generate --model "$MODEL" --device "$GPU" --chat --prompt "$PROMPT" --max-tokens 256 --spec "$spec" --json \
    > "$OUTDIR/generate-gpu-$spec.json" 2> "$OUTDIR/generate-gpu-$spec.log" || { rc=1; tail -n 5 "$OUTDIR/generate-gpu-$spec.log"; }
done
python3 - "$OUTDIR" <<'PY' || rc=1
import json, sys
d = sys.argv[1]
a, b = (json.load(open(f"{d}/generate-gpu-{s}.json")) for s in ("off", "ngram"))
for s, r in (("off", a), ("ngram", b)):
    t = r["timings"]
    print(f"generate --spec {s}: {r['usage']['completion_tokens']} tokens, "
          f"decode {r['usage']['completion_tokens'] / max(t['decode_s'], 1e-9):.0f} tok/s, tau {r['speculative']['tau']:.2f}, device {r['device']}")
assert a["token_ids"] == b["token_ids"], "generate: ngram differs from AR on the GPU"
print("generate: ngram token ids identical to AR")
PY
# Where a step's time goes per prompt (decode at long context is attention-bound).
for spec in off ngram; do
  python3 scripts/generate_timings.py --bin "$BIN" --model "$MODEL" --device "$GPU" --kinds prose,long_context \
    --spec "$spec" > "$OUTDIR/timings-gpu-$spec.txt" 2>&1 || rc=1
  echo "--- generate timings, $GPU, --spec $spec"; cat "$OUTDIR/timings-gpu-$spec.txt"
done
PID=$(serve cpu 8101 "$OUTDIR/serve-cpu.log")
python3 scripts/engine_gate.py --base-url http://127.0.0.1:8101 --levels 4 --out "$OUTDIR/gate-cpu.json" $GATE_ARGS > "$OUTDIR/gate-cpu.txt" 2>&1 || rc=1
tail -n 3 "$OUTDIR/gate-cpu.txt"
python3 scripts/concurrency_bench.py --base-url http://127.0.0.1:8101 --levels "$LEVELS" --modes off,ngram --max-tokens 128 > "$OUTDIR/sweep-cpu.txt" 2>&1
kill "$PID"; wait "$PID" 2>/dev/null
# A cold reference: the GPU server without prefix reuse (every prompt prefilled in full).
PID=$(serve "$GPU" 8102 "$OUTDIR/serve-gpu-cold.log" --prefix-cache-mb 0)
python3 scripts/engine_gate.py --base-url http://127.0.0.1:8102 --levels 4 --out "$OUTDIR/gate-gpu-cold.json" $GATE_ARGS \
  > "$OUTDIR/gate-gpu-cold.txt" 2>&1 || rc=1
tail -n 3 "$OUTDIR/gate-gpu-cold.txt"
kill "$PID"; wait "$PID" 2>/dev/null
PID=$(serve "$GPU" 8100 "$OUTDIR/serve-gpu.log")
python3 scripts/engine_gate.py --base-url http://127.0.0.1:8100 --levels 4,16,32,64 --out "$OUTDIR/gate-gpu.json" $GATE_ARGS \
  --compare "$OUTDIR/gate-gpu-cold.json" --must-match "$OUTDIR/gate-gpu-cold.json" \
  --compare "$OUTDIR/gate-cpu.json" > "$OUTDIR/gate-gpu.txt" 2>&1 || rc=1
tail -n 9 "$OUTDIR/gate-gpu.txt"
python3 scripts/concurrency_bench.py --base-url http://127.0.0.1:8100 --levels "$LEVELS,64" --modes off,ngram --max-tokens 128 > "$OUTDIR/sweep-gpu.txt" 2>&1
kill "$PID"; wait "$PID" 2>/dev/null
# The engine alone (no HTTP): aggregate decode of N concurrent greedy requests, argmax-only rows
# on and off side by side, and the CPU for scale.
for am in 1 0; do
  SPECULA_DEVICE_ARGMAX=$am "$BIN" bench --engine --model "$MODEL" --device "$GPU" --streams "$LEVELS,64" \
    --gen-tokens 128 --prompt-tokens 64 --runs 3 > "$OUTDIR/engine-gpu-argmax$am.json" 2> "$OUTDIR/engine-gpu-argmax$am.log" || rc=1
  echo "--- engine bench, $GPU, SPECULA_DEVICE_ARGMAX=$am"; grep -v INFO "$OUTDIR/engine-gpu-argmax$am.log" | tail -n 12
done
"$BIN" bench --engine --model "$MODEL" --streams 1,16 --gen-tokens 128 --prompt-tokens 64 --runs 1 \
  > "$OUTDIR/engine-cpu.json" 2> "$OUTDIR/engine-cpu.log" || rc=1
echo "--- engine bench, cpu"; grep -v INFO "$OUTDIR/engine-cpu.log" | tail -n 6
grep -h "target on cuda\|error\|panick" "$OUTDIR"/serve-gpu.log | head -n 5
echo "--- sweep cpu"; tail -n 12 "$OUTDIR/sweep-cpu.txt"
echo "--- sweep gpu"; tail -n 14 "$OUTDIR/sweep-gpu.txt"
tar czf "$DEST/gpu_engine.tgz" -C "$OUTDIR" .
cp "$OUTDIR"/engine-*.json "$DEST"/ 2>/dev/null
exit $rc
