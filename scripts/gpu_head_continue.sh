#!/bin/bash
# Device job (docs/gpu.md, "Training drafters on the GPU"; planned in session 28, cut short when
# the device was withdrawn during its teacher pass): the committed fused MTP head continued on
# the answers to all 10,035 built-in prompts, the teacher pass on the GPU (its first run with
# several taps).
#   E:  the committed head evaluated at lr 0 on the new data: its held-out agreement checks the
#       GPU taps (below 0.6 means they are wrong, and nothing is trained);
#   W3: depth 1, 3 epochs at 4e-4;  D2: chain depth 2 (the second draft trained too), 1.5 epochs.
# usage (on the device, from the repository root): scripts/gpu_head_continue.sh BINARY_XZ MODEL
set -u
B=${1:?binary}; M=${2:?model}
H=heads/smollm2-135m-instruct.mtp
C="--prompts 10035 --answer-tokens 192 --draft-vocab 12288 --batch 4 --target-layers 1,15,29 --init $H"
date
scripts/gpu_distill.sh "$B" "$M" /tmp/runE $C --steps 1 --lr 0 --warmup 0 > /tmp/runE.log 2>&1
echo "stage 1 rc $?"; date
python3 - <<'PY' || { echo "GPU taps check failed: not training"; exit 1; }
import json
t = json.load(open('/tmp/runE/config.json'))['training']
print('committed head on GPU features: held-out answers', t.get('held_out_top1_answers'))
assert t['held_out_top1_answers'] > 0.6
PY
for r in W3 D2; do mkdir -p /tmp/run$r && cp -al /tmp/runE/data /tmp/run$r/; done
scripts/gpu_distill.sh "$B" "$M" /tmp/runW3 $C --epochs 3 --lr 4e-4 --warmup 50 --checkpoint-every 1000 > /tmp/runW3.log 2>&1 &
scripts/gpu_distill.sh "$B" "$M" /tmp/runD2 $C --chain-depth 2 --epochs 1.5 --lr 3e-4 --warmup 50 --checkpoint-every 1000 > /tmp/runD2.log 2>&1 &
wait
echo "stage 2 done"; date
