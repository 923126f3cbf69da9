#!/bin/bash
# Side-by-side variants in one device call: `specula bench --device cuda:0` once per variant (same
# binary), one summary line each, plus the one-row step split by kernel and GEMM shape.
# usage: scripts/gpu_variants.sh BINARY_XZ OUTDIR SHAPE VARIANT [VARIANT...]
#   VARIANT: NAME or NAME:VAR=V+VAR=V... (environment for that run; NAME alone: none), e.g.
#   scripts/gpu_variants.sh .gpu/specula.xz $OUT qwen3-8b base:SPECULA_CUDA_FUSE_NORM=0 ring:SPECULA_CUDA_RING1=2x4
#   SPECULA_BENCH_ARGS (e.g. "--dtype q8_0") is passed to every run.
set -uo pipefail
BIN_XZ=${1:?binary}; OUTDIR=${2:?outdir}; SHAPE=${3:?shape}; shift 3
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
BIN=/tmp/$(basename "$BIN_XZ" .xz)
[ -x "$BIN" ] || { xz -d -c "$BIN_XZ" > "$BIN" && chmod +x "$BIN"; } || exit 1
rc=0
for variant in "$@"; do
  name=${variant%%:*}; envs=()
  [[ "$variant" == *:* ]] && IFS=+ read -ra envs <<< "${variant#*:}"
  tag="$SHAPE-$name"
  # A run that succeeds keeps only its receipt: the device returns a limited number of files
  # per call (8 in one measured call), and the log of a passing run says nothing the summary does not.
  if env "${envs[@]}" "$BIN" bench --device cuda:0 --shape "$SHAPE" ${SPECULA_BENCH_ARGS:-} \
    --receipt "$OUTDIR/$tag.json" > /dev/null 2> "$OUTDIR/$tag.log"; then
    rm -f "$OUTDIR/$tag.log"
  else
    rc=1; tail -n 3 "$OUTDIR/$tag.log"
  fi
  python3 - "$OUTDIR/$tag.json" "$variant" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
d = r["decode_batch1"]; e = r["exactness"]
agg = " ".join(f"{a['streams']}:{a['tok_s_aggregate']:.0f}" for a in r["aggregate_decode"])
ver = " ".join(f"{v['rows']}:{v['relative_to_one_row']:.2f}" for v in r["verify_cost"][:16:3])
pre = " ".join(f"{p['tokens']}:{p['tok_s']:.0f}" for p in r["prefill"])
print(f"{sys.argv[2]} {r['shape']['name']} {r['dtype']}: b1 {d['tok_s']:.1f} tok/s ({100*d['fraction_of_floor']:.0f}%) | agg {agg} | verify {ver} | prefill {pre} | exact {e['all_pass']}")
if not e["all_pass"]:
    print("  failed:", ", ".join(k for k, v in e.items() if isinstance(v, dict) and not v.get("pass")))
for p in r.get("kernel_profile") or []:
    if p["rows"] in (1, 64):
        top = ", ".join(f"{k['kernel']} {k['launches']}x {k['ms']:.3f}" for k in p["kernels"][:12])
        print(f"  profile {p['rows']} rows ({p.get('gemm_wide', '?')}): {p['total_ms']:.2f} ms: {top}")
PY
done
exit $rc
