#!/bin/bash
# Issue 34's measurements behind docs/results/gossip/report.md (root). Sequential on purpose: run it
# on an otherwise quiet machine; timings from a loaded one are not evidence.
#   bash docs/results/gossip/run.sh [OUT] [WHAT]     (OUT default docs/results/gossip; WHAT default all)
# WHAT:
#   cluster   8 ranks on 2 emulated nodes x 4 (shared memory inside a node, 100 Mbit/s between the
#             nodes; ../shared/tools/netem_mpi.sh), the medium LSTM, STEPS (20) optimizer steps of
#             train_lm.py per contender: step time and bytes per rank (results.json per_step);
#   slow      4 ranks on 4 emulated hosts with 10 Mbit/s links, the small LSTM, SLOW_STEPS (8) steps;
#   accuracy  the small LSTM, 4 ranks (no shaping), EPOCHS (2) epochs, seeds 1 2 3: perplexity of
#             each contender after the same epochs (gossip runs evaluate the network-average model);
#   report    mpi_scripts/report.py gossip over OUT (tables, targets met or missed).
# ONLY (labels, space-separated) restricts every part to those contenders; SEEDS (default "1 2 3")
# the accuracy seeds. Cells already in OUT are kept, so a later call adds the rest.
# Contenders: dense allreduce (none), top-k 1 % by allgather, gtopk 1 %, and decentralized on a
# ring: Choco-SGD with the scaled sign (gamma 0.45) and with top-k 1 % (gamma 0.04), PowerGossip,
# DCD-PSGD with QSGD (s = 16).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/results/gossip}
WHAT=${2:-all}
PY=$(pwd)/.venv/bin/python
NETEM=${NETEM:-../shared/tools/netem_mpi.sh}
STEPS=${STEPS:-20}
SLOW_STEPS=${SLOW_STEPS:-8}
EPOCHS=${EPOCHS:-2}
SEEDS=${SEEDS:-1 2 3}
ONLY=${ONLY:-}
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
CONTENDERS=(
  "none|--compressor none"
  "topk-allgather|--compressor topk:density=0.01"
  "gtopk|--compressor gtopk:density=0.01"
  "choco-sign|--gossip choco --topology ring --compressor sign --consensus-step 0.45"
  "choco-topk|--gossip choco --topology ring --compressor topk:density=0.01 --consensus-step 0.04"
  "powergossip|--gossip powergossip --topology ring --compressor none"
  "dcd-qsgd|--gossip dcd --topology ring --compressor qsgd"
)
ENV_VARS="OMPI_MCA_mpi_yield_when_idle=1 HOROVOD_CYCLE_TIME=5 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1"
export $ENV_VARS OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NETEM_PYTHON=$PY NETEM_SKIP_INSTALL=1

machine_before() {  # machine_before DIR: wait for a quiet machine (benchmarks/hygiene.py), record it
  mkdir -p "$1"
  "$PY" -c 'import json, sys; sys.path.insert(0, "benchmarks"); import hygiene
s = hygiene.wait_quiet(); json.dump({"before": s, "loaded": hygiene.is_loaded(s)}, open(sys.argv[1], "w"))' "$1/machine.json"
}

shaped() {  # shaped NAME HOSTS NP RATE MODEL STEPS
  local name=$1 hosts=$2 np=$3 rate=$4 model=$5 steps=$6
  trap 'bash "$NETEM" down' EXIT
  bash "$NETEM" up "$hosts"
  bash "$NETEM" shape "$rate"
  local xs=(); for v in $ENV_VARS; do xs+=(-x "$v"); done
  for c in "${CONTENDERS[@]}"; do
    local label=${c%%|*} args=${c#*|} dir="$OUT/$name/${c%%|*}"
    wanted "$label" || continue
    [ -f "$dir/results.json" ] && continue
    machine_before "$dir"
    # shellcheck disable=SC2086
    NETEM_TIMEOUT=1800 bash "$NETEM" mpirun -n "$np" "${xs[@]}" -- "$PY" "$(pwd)/mpi_scripts/train_lm.py" $args \
      --model "$model" --epochs 1 --max-steps "$steps" --no-progress --cost-model off \
      --output "$(pwd)/$dir" || echo "cell $name/$label failed" >&2
  done
  bash "$NETEM" down
  trap - EXIT
}

if [ "$WHAT" = all ] || [ "$WHAT" = cluster ]; then
  shaped cluster 2 8 100mbit medium "$STEPS"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = slow ]; then
  shaped slow 4 4 10mbit small "$SLOW_STEPS"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = accuracy ]; then
  for seed in $SEEDS; do
    for c in "${CONTENDERS[@]}"; do
      dir="$OUT/accuracy/${c%%|*}-seed$seed"
      wanted "${c%%|*}" || continue
      [ -f "$dir/results.json" ] && continue
      # shellcheck disable=SC2086
      mpirun -np 4 --oversubscribe --bind-to none "$PY" mpi_scripts/train_lm.py ${c#*|} --model small \
        --epochs "$EPOCHS" --seed "$seed" --no-progress --cost-model off --output "$dir"
    done
  done
fi
if [ "$WHAT" = all ] || [ "$WHAT" = report ]; then
  "$PY" mpi_scripts/report.py gossip --input "$OUT" --output "$OUT"
fi
