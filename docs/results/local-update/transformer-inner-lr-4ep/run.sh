#!/bin/bash
# Untimed inner learning-rate ablation behind docs/results/local-update/README.md, "Where plain
# averaging loses to synchronous AdamW": 4 ranks on this machine (no netem, 4 ranks on 2 cores: the
# step times in results.json are not evidence), 4 epochs, constant learning rate after warm-up,
# seed 1, dense Δ; the transformer-outer-momentum-4ep settings with the inner lr varied.
# Run from the repository root: bash docs/results/local-update/transformer-inner-lr-4ep/run.sh [OUTPUT_DIR]
set -u
OUT=${1:-runs/transformer-inner-lr-4ep}
. docs/results/local-update/untimed.sh   # launch environment and run()
TRAIN="$TRANSFORMER --epochs 4 --compressor none"
mkdir -p "$OUT"
run sync_lr1e-3 "$TRAIN" --lr 1e-3
run avg1_lr2e-3 "$TRAIN" --lr 2e-3 --local-steps 1 --outer-opt average
run avg8_lr2e-3 "$TRAIN" --lr 2e-3 --local-steps 8 --outer-opt average
run sync_lr2e-3 "$TRAIN" --lr 2e-3
run avg8_lr4e-3 "$TRAIN" --lr 4e-3 --local-steps 8 --outer-opt average
run avg1_lr1e-3 "$TRAIN" --lr 1e-3 --local-steps 1 --outer-opt average
