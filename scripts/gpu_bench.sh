#!/bin/bash
# Run Specula's GPU bench (exactness checks + timings) and the PyTorch baseline in one device call.
# usage: scripts/gpu_bench.sh BINARY_XZ OUTDIR SHAPE[,SHAPE...] [torch]
#   BINARY_XZ: the stripped, xz-compressed `specula` built with --features cuda (docs/gpu.md)
#   OUTDIR:    receipts and logs go here (<shape>.json, <shape>.log, torch-<shape>.json)
#   torch:     also run scripts/gpu_torch_baseline.py for each shape
set -uo pipefail
BIN_XZ=${1:?binary}; OUTDIR=${2:?outdir}; SHAPES=${3:-qwen3-8b}; TORCH=${4:-}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
BIN=/tmp/specula-cuda
xz -d -c "$BIN_XZ" > "$BIN" && chmod +x "$BIN" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUTDIR/nvidia-smi.txt"
rc=0
for s in ${SHAPES//,/ }; do
  echo "=== specula bench $s"
  "$BIN" bench --device cuda:0 --shape "$s" ${SPECULA_BENCH_ARGS:-} --receipt "$OUTDIR/$s.json" > /dev/null 2> "$OUTDIR/$s.log" || rc=1
  tail -n 3 "$OUTDIR/$s.log"
  python3 - "$OUTDIR/$s.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
d = r["decode_batch1"]
print(f"{r['shape']['name']}: floor {r['floor_tok_s']:.0f} tok/s, decode {d['tok_s']:.1f} tok/s ({100*d['fraction_of_floor']:.0f}% of floor)")
print("verify cost:", " ".join(f"{v['rows']}:{v['relative_to_one_row']:.2f}" for v in r["verify_cost"]))
print("aggregate:", " ".join(f"{a['streams']}:{a['tok_s_aggregate']:.0f}" for a in r["aggregate_decode"]))
print("prefill:", " ".join(f"{p['tokens']}:{p['tok_s']:.0f}" for p in r["prefill"]))
e = r["exactness"]
print("exact:", e["all_pass"], {k: v["pass"] for k, v in e.items() if isinstance(v, dict)})
if not e["all_pass"]:
    print(json.dumps({k: v for k, v in e.items() if isinstance(v, dict) and not v["pass"]})[:3000])
for p in r.get("kernel_profile") or []:
    top = ", ".join(f"{k['kernel']} {k['ms']:.3f}ms/{k['launches']}" for k in p["kernels"][:6])
    print(f"profile {p['rows']} rows: {p['total_ms']:.2f} ms: {top}")
g = r.get("gemv_reference")
if g:
    one = g["verify_cost"][0]["ms"]
    print(f"gemv reference: decode {1/g['step_s']:.1f} tok/s, verify:", " ".join(f"{v['rows']}:{v['relative_to_one_row']:.2f}" for v in g["verify_cost"]),
          "aggregate:", " ".join(f"{a['streams']}:{a['tok_s_aggregate']:.0f}" for a in g["aggregate"]))
PY
  if [ -n "$TORCH" ]; then
    echo "=== torch $s"
    PYTHONUNBUFFERED=1 python3 scripts/gpu_torch_baseline.py --shape "$s" --json "$OUTDIR/torch-$s.json" 2>&1 | grep -E "RESULT|Error|error" | tail -n 8
  fi
done
exit $rc
