#!/bin/bash
# Untimed Δ̄-geometry runs behind docs/results/local-update/README.md, "Why outer momentum stalls the
# transformer": 4 ranks on this machine (no netem; 4 ranks on 2 cores, so the step times in
# results.json are not evidence), 8 epochs, constant learning rate, seed 1, dense Δ, H = 8.
# Run from the repository root: bash docs/results/local-update/delta-cosine-8ep/run.sh [OUTPUT_DIR]
# (about 4.5 min per transformer run, 3.7 min per LSTM run), then summarize.py on OUTPUT_DIR.
set -u
HERE=docs/results/local-update/delta-cosine-8ep
OUT=${1:-runs/delta-cosine-8ep}
. docs/results/local-update/untimed.sh   # launch environment and run()
TF="--arch transformer --model small --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip 1.0"
LSTM="--arch lstm --model small --lr 20"
COMMON="--epochs 8 --warmup-steps 29 --anneal 1 --early-stop 0 --seed 1 --no-progress --compressor none --local-steps 8"
# cos NAME ARGS...: one run of delta_cosine.py writing $OUT/NAME.cos.json
cos() { local name=$1; shift; run "$name" "$HERE/delta_cosine.py $OUT/$name.cos.json -- $COMMON" "$@"; }
mkdir -p "$OUT"
cos tf_avg8 $TF --outer-opt average
cos tf_dl8 $TF --outer-opt diloco
cos tf_dl8_lr01 $TF --outer-opt diloco:outer_lr=0.1
cos lstm_avg8 $LSTM --outer-opt average
cos lstm_dl8 $LSTM --outer-opt diloco
