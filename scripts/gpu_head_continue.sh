#!/bin/bash
# Device job (docs/gpu.md, "Training drafters on the GPU"): the committed fused MTP head continued
# on the answers to all 10,035 built-in prompts, the answers decoded and the teacher pass run on
# the GPU (its several-tap copy: blocks 1, 15 and 29).
#   T:  the committed head evaluated at lr 0 on 300 prompts' GPU features: a held-out agreement
#       below 0.6 means the taps are wrong, and nothing else runs (about a minute);
#   E:  the same on all 10,035 prompts: the data and teacher cache the runs below share;
#   Wa: depth 1, 2 epochs at peak lr 3e-4;  Wb: depth 1, 3 epochs at peak lr 5e-4 (W2's recipe).
# Each stage logs to RUNS/<stage>.log; RUNS/DONE appears when all have finished.
# usage (on the device, from the repository root; start it with setsid so that it outlives the
# call): scripts/gpu_head_continue.sh BINARY_XZ MODEL RUNS
set -u
B=${1:?binary}; M=${2:?model}; R=${3:?runs dir}
H=heads/smollm2-135m-instruct.mtp
C="--answer-tokens 192 --draft-vocab 12288 --batch 4 --target-layers 1,15,29 --init $H"
mkdir -p "$R"
check() {
  python3 - "$1" <<'PY'
import json, sys
t = json.load(open(sys.argv[1] + '/config.json'))['training']
print(sys.argv[1], 'held-out answers', t.get('held_out_top1_answers'), 'depth 2', t.get('held_out_depth2_answers'))
assert t['held_out_top1_answers'] > 0.6
PY
}
date
scripts/gpu_distill.sh "$B" "$M" "$R/T" --prompts 300 $C --steps 1 --lr 0 --warmup 0 > "$R/T.log" 2>&1
check "$R/T" || { echo "GPU taps check failed: not training"; touch "$R/DONE"; exit 1; }
date
scripts/gpu_distill.sh "$B" "$M" "$R/E" --prompts 10035 $C --steps 1 --lr 0 --warmup 0 > "$R/E.log" 2>&1
check "$R/E" || { touch "$R/DONE"; exit 1; }
date
for r in Wa Wb; do mkdir -p "$R/$r" && cp -al "$R/E/data" "$R/$r/"; done
scripts/gpu_distill.sh "$B" "$M" "$R/Wa" --prompts 10035 $C --epochs 2 --lr 3e-4 --warmup 50 --checkpoint-every 1000 > "$R/Wa.log" 2>&1 &
scripts/gpu_distill.sh "$B" "$M" "$R/Wb" --prompts 10035 $C --epochs 3 --lr 5e-4 --warmup 50 --checkpoint-every 1000 > "$R/Wb.log" 2>&1 &
wait
for r in Wa Wb; do check "$R/$r"; done
date
touch "$R/DONE"
