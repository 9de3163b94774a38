#!/bin/bash
# Untimed run behind docs/results/local-update/README.md, "Where plain averaging loses to
# synchronous AdamW": plain averaging every H = 1, 4, 8 steps with dense Δ against synchronous
# AdamW on the small transformer, 15 epochs at the constant learning rate of
# transformer-10mbit-15ep-constant-lr (lr 1e-3 after 29 warm-up steps), seed 1, and H = 1 once more
# on 2 ranks. 4 ranks on this machine without netem (4 ranks on 2 cores: the step times in
# results.json are not evidence).
# Run from the repository root: bash docs/results/local-update/transformer-local-adamw-15ep/run.sh [OUTPUT_DIR]
set -u
OUT=${1:-runs/transformer-local-adamw-15ep}
. docs/results/local-update/untimed.sh   # launch environment and run()
TRAIN="$TRANSFORMER --lr 1e-3 --epochs 15 --early-stop 0 --compressor none"
mkdir -p "$OUT"
run avg1 "$TRAIN" --local-steps 1 --outer-opt average
run avg4 "$TRAIN" --local-steps 4 --outer-opt average
run avg8 "$TRAIN" --local-steps 8 --outer-opt average
run sync "$TRAIN"
# the same global batch (256 sequences) on 2 ranks: 128 per rank instead of 64
NP=2 run avg1_2ranks "$TRAIN" --local-steps 1 --outer-opt average
