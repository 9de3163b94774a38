#!/bin/bash
# Untimed outer-step ablation behind docs/results/local-update/README.md, "Outer momentum at H = 8 on
# the small transformer": 4 ranks on this machine (no netem, 4 ranks on 2 cores: the step times in
# results.json are not evidence), 4 epochs, constant learning rate, seed 1, dense Δ. Run from the
# repository root: bash docs/results/local-update/transformer-outer-momentum-4ep/run.sh [OUTPUT_DIR]
set -u
OUT=${1:-runs/transformer-outer-momentum-4ep}
PY=${PYTHON:-.venv/bin/python}
# the launch environment from hvdcomp/mpi.env (its one definition), with the Horovod cycle time
# the netem benchmark uses (20 ms), as these runs had
set -a; . hvdcomp/mpi.env; set +a
export HOROVOD_CYCLE_TIME=20
COMMON="--arch transformer --model small --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip 1.0 --epochs 4 --warmup-steps 29 --anneal 1 --seed 1 --no-progress --compressor none"
run() {
  name=$1; shift
  timeout 900 mpirun -n 4 --oversubscribe -x HOROVOD_CYCLE_TIME -x OMPI_MCA_mpi_yield_when_idle -x OMP_NUM_THREADS -x PYTHONUNBUFFERED \
    "$PY" mpi_scripts/train_lm.py $COMMON "$@" --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
mkdir -p "$OUT"
run sync
run avg1 --local-steps 1 --outer-opt average
run avg8 --local-steps 8 --outer-opt average
run dl8 --local-steps 8 --outer-opt diloco
run dl8_m05 --local-steps 8 --outer-opt diloco:outer_momentum=0.5
run dl8_lr07_m0 --local-steps 8 --outer-opt diloco:outer_momentum=0,nesterov=false
run dl8_heavyball --local-steps 8 --outer-opt diloco:nesterov=false
run dl32 --local-steps 32 --outer-opt diloco
run avg32 --local-steps 32 --outer-opt average
