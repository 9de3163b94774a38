#!/bin/bash
# Untimed (perplexity and bytes only; 2026-12-06): SparseLoCo on the small LSTM, 4 ranks on this
# machine, H = 8, 4 epochs at lr 20, with 2-bit (values=int2) and fp16 values: seed 1 on the study's
# plateau schedule, then seeds 1-2 with the learning rate held (--anneal 1 --early-stop 0),
# interleaved. Writes OUT/<schedule>-<values>-s<seed>/results.json (OUT: runs/sparseloco-int2).
# Run from the project root: bash docs/results/local-update/sparseloco-int2/run.sh
# (sparseloco:form=flat is the form these runs used, then built by --outer-opt sparseloco.)
set -u
OUT=${OUT:-runs/sparseloco-int2}
PY=${PYTHON:-.venv/bin/python}
set -a; . hvdcomp/mpi.env; set +a
export HOROVOD_CYCLE_TIME=20
run() { local name=$1 values=$2 seed=$3; shift 3
  rm -rf "$OUT/$name"
  timeout 1800 mpirun -np 4 --oversubscribe --bind-to none -x HOROVOD_CYCLE_TIME "$PY" mpi_scripts/train_lm.py \
    --arch lstm --model small --lr 20 --epochs 4 --warmup-steps 29 "$@" \
    --local-steps 8 --outer-opt sparseloco:form=flat --compressor "topk:density=0.02,values=$values,index=compact" --seed "$seed" \
    --no-progress --data ../shared/data/tinyshakespeare/input.txt --output "$OUT/$name" 2>&1 | grep SUMMARY
}
for v in int2 fp16; do
  run "plateau-$v-s1" "$v" 1 --anneal 4 --min-improvement 0.01 --early-stop 2 --min-epochs 6
done
for seed in 1 2; do for v in int2 fp16; do
  run "const-$v-s$seed" "$v" "$seed" --anneal 1 --early-stop 0
done; done
