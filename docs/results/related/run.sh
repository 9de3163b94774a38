#!/bin/bash
# Issue 15's measurements behind docs/results/related/, exactly as run (root for step 3; ~40 min on
# 2 cores). Sequential on purpose: run it on an otherwise quiet machine.
#   bash docs/results/related/run.sh [OUT] [all|fit|speed]      (default docs/results/related)
# 1. SIDCo: kept/k of the fitted thresholds on Laplace data and real LSTM gradients (one process);
# 2. adaptive (L-GreCo): compression error of the per-layer plan against the uniform setting at
#    equal bytes, on real LSTM gradients (one process);
# 3. speed: the new methods on 4 emulated hosts (medium LSTM, links shaped at 1 Gbit/s, 100 Mbit/s and
#    10 Mbit/s) beside hvdcomp none, hvdcomp top-k 1 % and stock Horovod fp16 run in the same sitting,
#    then their speed tables (mpi_scripts/report.py speed on these cells only).
# The 2-epoch study cells of the new methods are `make study-v1` (mpi_scripts/grids/related_small.yaml); study v2 (`make study`) has them too.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/results/related}
WHAT=${2:-all}
PY=.venv/bin/python
case "$WHAT" in all|fit|speed) ;; *) echo "usage: $0 [OUT] [all|fit|speed]" >&2; exit 2 ;; esac
if [ "$WHAT" != speed ]; then
  $PY benchmarks/sidco_fit.py --output "$OUT/sidco_fit.json" | tee "$OUT/sidco_fit.md"
  $PY benchmarks/adaptive_error.py --output "$OUT/adaptive_error.json" | tee "$OUT/adaptive_error.md"
fi
if [ "$WHAT" != fit ]; then
  C="hvdcomp:none hvdcomp:topk:density=0.01 horovod:fp16 hvdcomp:sidco:density=0.01 hvdcomp:sbc:density=0.01
     hvdcomp:lowbit:bits=4 hvdcomp:lowbit:bits=8 hvdcomp:adaptive:base=topk,budget=0.01,every=10"
  $PY benchmarks/netem_e2e.py --output "$OUT/netem-e2e" --model medium --rates 1gbit 100mbit 10mbit \
    --steps 5 --warmup 2 --steps-slow 3 --warmup-slow 1 --contenders $C
  $PY mpi_scripts/report.py speed --e2e "$OUT/netem-e2e" --e2e-transformer "$OUT/none" --comm "$OUT/none" \
    --output "$OUT/speed"
fi
