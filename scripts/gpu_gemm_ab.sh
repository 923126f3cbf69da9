#!/bin/bash
# Side-by-side GEMM variants in one device call: `specula bench --device cuda:0` once per value of
# an environment variable (same binary, alternated over ROUNDS), one summary line each.
# usage: scripts/gpu_gemm_ab.sh BINARY_XZ OUTDIR SHAPE VAR VALUE[,VALUE...] [ROUNDS]
#   e.g. scripts/gpu_gemm_ab.sh .gpu/specula.xz $OUT qwen3-8b SPECULA_CUDA_GEMM_PIPE 0,1,2
set -uo pipefail
BIN_XZ=${1:?binary}; OUTDIR=${2:?outdir}; SHAPE=${3:?shape}; VAR=${4:?variable}; VALUES=${5:?values}; ROUNDS=${6:-1}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
BIN=/tmp/specula-cuda
[ -x "$BIN" ] || { xz -d -c "$BIN_XZ" > "$BIN" && chmod +x "$BIN"; } || exit 1
rc=0
for i in $(seq "$ROUNDS"); do
  for v in ${VALUES//,/ }; do
    tag="$SHAPE-$v-$i"
    env "$VAR=$v" "$BIN" bench --device cuda:0 --shape "$SHAPE" ${SPECULA_BENCH_ARGS:-} \
      --receipt "$OUTDIR/$tag.json" > /dev/null 2> "$OUTDIR/$tag.log" || { rc=1; tail -n 5 "$OUTDIR/$tag.log"; }
    python3 - "$OUTDIR/$tag.json" "$VAR=$v" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
d = r["decode_batch1"]; e = r["exactness"]
agg = " ".join(f"{a['streams']}:{a['tok_s_aggregate']:.0f}" for a in r["aggregate_decode"])
ver = " ".join(f"{v['rows']}:{v['relative_to_one_row']:.2f}" for v in r["verify_cost"][:8])
pre = " ".join(f"{p['tokens']}:{p['tok_s']:.0f}" for p in r["prefill"])
print(f"{sys.argv[2]} {r['shape']['name']} {r['dtype']}: b1 {d['tok_s']:.1f} tok/s ({100*d['fraction_of_floor']:.0f}%) | agg {agg} | verify {ver} | prefill {pre} | exact {e['all_pass']}")
if not e["all_pass"]:
    print(json.dumps({k: v for k, v in e.items() if isinstance(v, dict) and not v.get("pass")})[:2000])
for p in r.get("kernel_profile") or []:
    if p["rows"] == 64:
        top = ", ".join(f"{k['kernel']} {k['ms']:.2f}" for k in p["kernels"][:4])
        print(f"  profile 64 rows wide {p['gemm_wide_mt']}: {p['total_ms']:.2f} ms: {top}")
PY
  done
done
exit $rc
