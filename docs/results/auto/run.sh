#!/bin/bash
# Issue 59's grid for compression="auto" on emulated links, as docs/results/auto's tables were run:
# `sync|auto` (no tuning) against the static contenders of the issue (Horovod's fastest
# configuration, the fp16 ring; top-k 1 % and 0.1 %; PowerSGD rank 1/2/4; QSGD; DGC), all
# synchronous per step, 4 epochs, 4 ranks on 4 emulated hosts, one output directory per workload
# and rate, each followed by its report. Root (network namespaces). Resumable: finished cells are
# kept (rerun the same command). Two stages, one sitting:
#   bash docs/results/auto/run.sh [OUT] [RATES] [STAGE] [BEST]
#     OUT    default runs/auto
#     RATES  "10mbit 100mbit" (default), or one of them
#     STAGE  grid: every contender at seed 1 (default); seeds: seeds 2 and 3 of auto and of BEST
#     BEST   the best static contender of the grid (stage seeds), e.g. "sync|powersgd:matrix_rank=2"
#   PYTHON       the interpreter (default .venv/bin/python)
#   MAX_WAIT     seconds each cell waits for a quiet machine (default 30: the shared machine is
#                never quiet; the load is recorded per cell)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/auto}
RATES=${2:-10mbit 100mbit}
STAGE=${3:-grid}
BEST=${4:-}
PY=${PYTHON:-.venv/bin/python}
contenders=("sync|auto" "sync|fp16@ring" "sync|powersgd:matrix_rank=2" "sync|topk:density=0.01"
            "sync|powersgd:matrix_rank=1" "sync|powersgd:matrix_rank=4" "sync|topk:density=0.001"
            "sync|qsgd" "sync|dgc")
seeds=(1)
if [ "$STAGE" = seeds ]; then
  [ -n "$BEST" ] || { echo "stage seeds needs BEST (the best static contender of the grid)" >&2; exit 2; }
  contenders=("sync|auto" "$BEST")
  seeds=(2 3)
elif [ "$STAGE" != grid ]; then
  echo "unknown stage '$STAGE': grid or seeds" >&2; exit 2
fi
status=0
for rate in $RATES; do
  dir="$OUT/lstm-$rate"
  "$PY" benchmarks/netem_local.py --workload lstm --output "$dir" --rates "$rate" --seeds "${seeds[@]}" \
    --max-wait-quiet "${MAX_WAIT:-30}" --contenders "${contenders[@]}" --train-args "--epochs 4" \
    --timeout 1800 --python "$PY" --netem-prefix hvdaut || status=1
  "$PY" mpi_scripts/report.py local --output "$dir" --include-loaded || status=1
done
exit $status
