#!/bin/bash
# Issue 32's local-update grid on emulated links, as docs/results/local-update's one-sitting grids
# were run: 14 contenders (the fp16 ring and top-k 1 % synchronous; DiLoCo and CO2 at H = 8 and 32,
# Δ by none / fp16 / top-k 1 %), 4 epochs, seed 1, 4 ranks on 4 emulated hosts, one output
# directory per workload and rate, each followed by its report. Root (network namespaces);
# 40-70 min per workload and rate on 2 cores (the 2026-12-05 sittings). Sequential on purpose:
# keep the machine otherwise quiet while it runs (each cell waits up to 5 min for a load under the
# core count and records the load, and run.json the CPU). Resumable: finished cells are kept.
#   bash docs/results/local-update/run.sh [OUT] [WORKLOADS] [RATES]
#     OUT        default runs/local-update (`make speed-local` too)
#     WORKLOADS  "lstm transformer" (default), or one of them
#     RATES      "10mbit 100mbit" (default), or one of them
#   PYTHON       the interpreter (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/local-update}
WORKLOADS=${2:-lstm transformer}
RATES=${3:-10mbit 100mbit}
PY=${PYTHON:-.venv/bin/python}
TOPK=topk:density=0.01
status=0
for workload in $WORKLOADS; do
  # CO2 on the LSTM (inner SGD at lr 20) with the staleness penalty λ = 4, the best of the 12-03
  # ablation (λ = 1 diverges there); on the transformer with its authors' defaults
  case "$workload" in
    lstm) co2="co2:gap_penalty=4" ;;
    transformer) co2="co2" ;;
    *) echo "unknown workload '$workload': lstm or transformer" >&2; exit 2 ;;
  esac
  contenders=("sync|fp16@ring" "diloco|8|$TOPK" "sync|$TOPK" "diloco|8|none" "diloco|8|fp16"
              "diloco|32|none" "diloco|32|fp16" "diloco|32|$TOPK")
  for h in 8 32; do
    for delta in none fp16 "$TOPK"; do contenders+=("$co2|$h|$delta"); done
  done
  for rate in $RATES; do
    dir="$OUT/$workload-$rate"
    "$PY" benchmarks/netem_local.py --workload "$workload" --output "$dir" --rates "$rate" --seeds 1 \
      --max-wait-quiet 300 --contenders "${contenders[@]}" --train-args "--epochs 4" --timeout 1800 || status=1
    "$PY" mpi_scripts/report.py local --output "$dir" || status=1
  done
done
exit $status
