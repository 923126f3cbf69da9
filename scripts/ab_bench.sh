#!/bin/bash
# Side-by-side speed of two builds on this noisy machine: alternate `A bench --json ARGS` and
# `B bench --json ARGS` ROUNDS times, read one number from each JSON with a Python expression over
# `d`, and print every pair and the median of the paired ratios B/A.
#
#   scripts/ab_bench.sh OLD NEW ROUNDS EXPR -- BENCH ARGS...
#   scripts/ab_bench.sh /tmp/specula-old target/release/specula 6 \
#       '[l for l in d["levels"] if l["mode"] == "off" and l["streams"] == 16][0]["aggregate_decode_tok_s"]' \
#       -- --engine --model smollm2-135m-instruct --streams 16 --gen-tokens 64 --prompt-tokens 64 --runs 1
#   scripts/ab_bench.sh /tmp/specula-old target/release/specula 5 'd["prefill_tok_s"]' \
#       -- --model smollm2-135m-instruct --prompt-tokens 512 --gen-tokens 4 --runs 3
set -euo pipefail
if [ $# -lt 5 ] || [ "$5" != "--" ]; then
    sed -n '2,11p' "$0" >&2
    exit 2
fi
A=$1; B=$2; R=$3; E=$4; shift 5
for _ in $(seq "$R"); do
    a=$("$A" bench --json "$@" 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print($E)")
    b=$("$B" bench --json "$@" 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print($E)")
    echo "$a $b"
done | python3 -c '
import statistics, sys
p = [tuple(map(float, l.split())) for l in sys.stdin if len(l.split()) == 2]
for a, b in p:
    print(f"{a:.2f} {b:.2f} {b / a:.3f}")
print("median A %.2f B %.2f, paired ratio B/A median %.3f" % (
    statistics.median(a for a, _ in p), statistics.median(b for _, b in p), statistics.median(b / a for a, b in p)))'
