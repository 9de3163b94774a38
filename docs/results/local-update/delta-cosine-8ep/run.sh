#!/bin/bash
# Untimed Δ̄-geometry runs behind docs/results/local-update/README.md, "Why outer momentum stalls the
# transformer": 4 ranks on this machine (no netem; 4 ranks on 2 cores, so the step times in
# results.json are not evidence), 8 epochs, constant learning rate, seed 1, dense Δ, H = 8.
# Run from the repository root: bash docs/results/local-update/delta-cosine-8ep/run.sh [OUTPUT_DIR]
# (about 4.5 min per transformer run, 3.7 min per LSTM run), then summarize.py on OUTPUT_DIR.
set -u
HERE=docs/results/local-update/delta-cosine-8ep
OUT=${1:-runs/delta-cosine-8ep}
PY=${PYTHON:-.venv/bin/python}
set -a; . hvdcomp/mpi.env; set +a
export HOROVOD_CYCLE_TIME=20
TF="--arch transformer --model small --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip 1.0"
LSTM="--arch lstm --model small --lr 20"
COMMON="--epochs 8 --warmup-steps 29 --anneal 1 --early-stop 0 --seed 1 --no-progress --compressor none --local-steps 8"
run() {
  name=$1; shift
  timeout 1200 mpirun -n 4 --oversubscribe -x HOROVOD_CYCLE_TIME -x OMPI_MCA_mpi_yield_when_idle -x OMP_NUM_THREADS -x PYTHONUNBUFFERED \
    "$PY" $HERE/delta_cosine.py "$OUT/$name.cos.json" -- $COMMON "$@" --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
}
mkdir -p "$OUT"
run tf_avg8 $TF --outer-opt average
run tf_dl8 $TF --outer-opt diloco
run tf_dl8_lr01 $TF --outer-opt diloco:outer_lr=0.1
run lstm_avg8 $LSTM --outer-opt average
run lstm_dl8 $LSTM --outer-opt diloco
