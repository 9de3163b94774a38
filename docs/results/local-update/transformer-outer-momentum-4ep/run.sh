#!/bin/bash
# Untimed outer-step ablation behind docs/results/local-update/README.md, "Outer momentum at H = 8 on
# the small transformer": 4 ranks on this machine (no netem, 4 ranks on 2 cores: the step times in
# results.json are not evidence), 4 epochs, constant learning rate, seed 1, dense Δ. Run from the
# repository root: bash docs/results/local-update/transformer-outer-momentum-4ep/run.sh [OUTPUT_DIR]
set -u
OUT=${1:-runs/transformer-outer-momentum-4ep}
. docs/results/local-update/untimed.sh   # launch environment and run()
TRAIN="$TRANSFORMER --lr 1e-3 --epochs 4 --compressor none"
mkdir -p "$OUT"
run sync "$TRAIN"
run avg1 "$TRAIN" --local-steps 1 --outer-opt average
run avg8 "$TRAIN" --local-steps 8 --outer-opt average
run dl8 "$TRAIN" --local-steps 8 --outer-opt diloco
run dl8_m05 "$TRAIN" --local-steps 8 --outer-opt diloco:outer_momentum=0.5
run dl8_lr07_m0 "$TRAIN" --local-steps 8 --outer-opt diloco:outer_momentum=0,nesterov=false
run dl8_heavyball "$TRAIN" --local-steps 8 --outer-opt diloco:nesterov=false
run dl32 "$TRAIN" --local-steps 32 --outer-opt diloco
run avg32 "$TRAIN" --local-steps 32 --outer-opt average
