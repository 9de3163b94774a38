#!/bin/bash
# Issue 14's measurements behind docs/results/scaleout/report.md, exactly as run (root; ~30 min on
# 2 cores). Sequential on purpose: run it on an otherwise quiet machine.
#   bash docs/results/scaleout/run.sh [OUT]      (default docs/results/scaleout)
# 1. communication only, 8 ranks as 2 emulated nodes x 4 (shared memory inside a node, links
#    between the nodes shaped at 1 Gbit/s and 100 Mbit/s): synchronize() of each method on the
#    medium LSTM's fixed gradients (benchmarks/comm_lm.py through benchmarks/netem_e2e.py);
# 2. accuracy cost: the small LSTM, 4 ranks, 2 epochs, seeds 1 and 2, top-k 1 % by allgather against
#    gtopk and cltk at the same density, twophase (scaled sign) and none;
# 3. (WHAT=hierarchical) the node-aware allgather against the flat one, same cluster and gradients:
#    top-k 1 % and QSGD, each by flat and by hierarchical allgather, into OUT/cluster-hierarchical;
# 4. the report (fitted model to 1024 ranks + the measurements).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/results/scaleout}
PY=.venv/bin/python
WHAT=${2:-all}
M="none fp16 topk:density=0.01 gtopk:density=0.01 gtopk:density=0.01,hierarchical=true cltk:density=0.01 qsgd
   twophase:base=qsgd twophase"
if [ "$WHAT" = all ] || [ "$WHAT" = cluster ]; then
$PY benchmarks/netem_e2e.py --bench comm --output "$OUT/cluster" --model medium --np 8 --hosts 2 \
  --rates 1gbit 100mbit --comm-reps 5 --comm-budget 20 --comm-budget-slow 20 \
  --worker-args=--collectives --methods $M ${FORCE:-}
fi
if [ "$WHAT" = all ] || [ "$WHAT" = hierarchical ]; then
$PY benchmarks/netem_e2e.py --bench comm --output "$OUT/cluster-hierarchical" --model medium --np 8 --hosts 2 \
  --rates 1gbit 100mbit --comm-reps 5 --comm-budget 20 --comm-budget-slow 20 --worker-args=--collectives \
  --methods topk:density=0.01 topk:density=0.01@allgather=hierarchical qsgd qsgd@allgather=hierarchical ${FORCE:-}
fi
if [ "$WHAT" = all ] || [ "$WHAT" = accuracy ]; then
# the Makefile's settings for runs on this machine (root, ranks may outnumber cores)
set -a; . hvdcomp/mpi.env; set +a  # the launch environment (its one definition)
for seed in 1 2; do
for spec in topk:density=0.01 gtopk:density=0.01 cltk:density=0.01 twophase none; do
  dir="$OUT/accuracy/$(echo "$spec" | tr ':=,' '_-_')"
  [ "$seed" = 1 ] || dir="$dir-seed$seed"
  [ -f "$dir/results.json" ] && continue
  mpirun -np 4 --oversubscribe --bind-to none $PY mpi_scripts/train_lm.py --compressor "$spec" \
    --model small --epochs 2 --seed $seed --no-progress --output "$dir"
done
done
fi
MEASURED="$OUT/cluster"
[ -d "$OUT/cluster-hierarchical" ] && MEASURED="$MEASURED $OUT/cluster-hierarchical"
$PY benchmarks/scaleout_model.py --summary docs/results/speed/summary.json --measured $MEASURED \
  --accuracy "$OUT/accuracy" --output "$OUT"
