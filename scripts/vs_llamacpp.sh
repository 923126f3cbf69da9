#!/usr/bin/env bash
# Side-by-side CPU speed against llama.cpp on the same GGUF file (issue "Serve a real model",
# done-when 6): alternating rounds of `llama-bench` and `specula bench`, same threads, same
# prompt and generation lengths, then the median of each and their ratio.
#
#   scripts/vs_llamacpp.sh LLAMA_BENCH SPECULA MODEL.gguf [ROUNDS] [THREADS]
#
# LLAMA_BENCH is a llama.cpp `llama-bench` built with -DGGML_NATIVE=ON (not part of this
# repository); weights are read into memory (`-lm none`), as Specula loads them.
set -euo pipefail
usage() {
  echo "usage: $0 LLAMA_BENCH SPECULA MODEL.gguf [ROUNDS=4] [THREADS=2]" >&2
  echo "  LLAMA_BENCH: llama.cpp's llama-bench (build it yourself); SPECULA: target/release/specula" >&2
  exit 2
}
[ $# -ge 3 ] && [ "$1" != "-h" ] && [ "$1" != "--help" ] || usage
LB=$1; SP=$2; M=$3; ROUNDS=${4:-4}; T=${5:-2}
for exe in "$LB" "$SP"; do
  [ -x "$exe" ] || { echo "$0: $exe is not an executable" >&2; usage; }
done
[ -f "$M" ] || { echo "$0: no model file $M" >&2; usage; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq "$ROUNDS"); do
  "$LB" -m "$M" -t "$T" -p 512 -n 128 -r 3 -lm none -o json 2>/dev/null \
    | python3 -c 'import json,sys
for t in json.load(sys.stdin):
    k = "pp" if t["n_prompt"] > 0 else "tg"
    print(k, t["avg_ts"])' >> "$tmp/llama"
  "$SP" bench --model "$M" --threads "$T" --prompt-tokens 512 --gen-tokens 128 --runs 3 --json 2>/dev/null \
    | python3 -c 'import json,sys
d = json.load(sys.stdin)
print("pp", d["prefill_tok_s"]); print("tg", d["decode_tok_s"])' >> "$tmp/specula"
  echo "round $r: llama.cpp $(tr '\n' ' ' < <(tail -2 "$tmp/llama")) | specula $(tr '\n' ' ' < <(tail -2 "$tmp/specula"))"
done
python3 - "$tmp" <<'PY'
import statistics, sys
d = sys.argv[1]
def med(f, k):
    return statistics.median(float(l.split()[1]) for l in open(f"{d}/{f}") if l.startswith(k))
for k, name in (("pp", "prefill pp512"), ("tg", "decode tg128")):
    l, s = med("llama", k), med("specula", k)
    print(f"{name}: llama.cpp {l:.1f} tok/s, specula {s:.1f} tok/s, ratio {s / l:.2f}x")
PY
