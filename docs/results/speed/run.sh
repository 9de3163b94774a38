#!/bin/bash
# The speed study behind docs/results/speed/report.md, exactly as run (root; about 1.7 h on 2 cores).
# Sequential on purpose: keep the machine otherwise quiet while it runs. Resumable (finished cells
# are kept). Writes OUT/netem-e2e, OUT/netem-e2e-transformer, OUT/netem-comm, OUT/kernels-cpu,
# OUT/overhead and OUT/report.md + plots.
#   bash docs/results/speed/run.sh [OUT] [all|transformer|overhead]
#     OUT          default runs/speed; `make speed` uses docs/results/speed
#     overhead     only step 5 (issue 17's per-tensor overhead, 2 and 4 ranks; ~25 min), then the report
#     transformer  only step 2b (issue 17's transformer target at 4 ranks, 100 Mbit/s; ~10 min), then
#                  the report, whose "Transformer encoder (issue 17)" table gives the verdicts
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/speed}
WHAT=${2:-all}
PY=.venv/bin/python
C="hvdcomp:none hvdcomp:fp16 hvdcomp:topk:density=0.01 hvdcomp:topk:density=0.001 hvdcomp:dgc:density=0.01
   hvdcomp:dgc:density=0.001 hvdcomp:qsgd hvdcomp:powersgd:rank=2 hvdcomp:topk:density=0.01,select=sample,index=compact
   horovod:none horovod:fp16 horovod-ring:none horovod-ring:fp16 ddp:none ddp:fp16 ddp:powersgd
   hvdcomp:sidco:density=0.01 hvdcomp:sbc:density=0.01 hvdcomp:lowbit:bits=4 hvdcomp:lowbit:bits=8
   hvdcomp:adaptive:base=topk,budget=0.01,every=10"
# the transformer target's contenders: the two methods (top-k also per bucket: 146 small tensors),
# every stock Horovod configuration, DDP fp16 (hvdcomp none for context)
T="hvdcomp:topk:density=0.01 hvdcomp:topk:density=0.01@bucket hvdcomp:powersgd:rank=2 hvdcomp:none
   horovod:none horovod:fp16 horovod-ring:none horovod-ring:fp16 ddp:fp16"
case "$WHAT" in all|transformer|overhead) ;; *) echo "usage: $0 [OUT] [all|transformer|overhead]" >&2; exit 2 ;; esac
status=0
if [ "$WHAT" = all ]; then
# 1. unlimited links: 30 steps each, validation every 5 (steps to the target perplexity)
$PY benchmarks/netem_e2e.py --output "$OUT/netem-e2e" --model medium --rates none \
  --steps 27 --warmup 3 --eval-every 5 --contenders $C || status=1
# 2. rate-limited links: step time only
$PY benchmarks/netem_e2e.py --output "$OUT/netem-e2e" --model medium --rates 1gbit 100mbit 10mbit \
  --steps 5 --warmup 2 --steps-slow 3 --warmup-slow 1 --contenders $C || status=1
fi
# 2b. transformer encoder (146 tensors, synthetic data), 4 ranks at 100 Mbit/s: 3 warm-up + 10 timed steps
if [ "$WHAT" != overhead ]; then
$PY benchmarks/netem_e2e.py --output "$OUT/netem-e2e-transformer" --model transformer --rates 100mbit \
  --steps 10 --warmup 3 --contenders $T || status=1
fi
if [ "$WHAT" = all ]; then
# 3. communication only, 2 and 4 ranks: data for the alpha-beta fit
$PY benchmarks/netem_e2e.py --bench comm --output "$OUT/netem-comm" --model medium --np 2 4 \
  --rates 1gbit 100mbit --comm-reps 5 --comm-budget 8 --comm-budget-slow 8 \
  --methods none fp16 topk:density=0.01 topk:density=0.001 dgc:density=0.01 qsgd powersgd:rank=2 || status=1
# 4. kernels (one process), then the report
$PY benchmarks/kernels.py --output "$OUT/kernels-cpu" --sizes 4M 16M --threads 2 --repeat 5 --compare \
  --profile "qsgd:levels=16" "topk:density=0.01" "dgc:density=0.01" || status=1
fi
# 5. per-tensor overhead on models with many tensors, 2 and 4 ranks on this machine's loopback
if [ "$WHAT" != transformer ]; then
for np in 2 4; do
  # (the response cache must hold every contender's tensor names, as it holds one model's in a
  # real job: with the default 1024 entries, 13 contenders x 400 names evict each other)
  # (the launch environment from hvdcomp/mpi.env, its one definition; a faster Horovod cycle here)
  ( set -a; . hvdcomp/mpi.env; set +a
    HOROVOD_CYCLE_TIME=1 HOROVOD_CACHE_CAPACITY=16384 timeout 3600 \
    mpirun -np $np --oversubscribe --bind-to none \
    $PY benchmarks/overhead.py --output "$OUT/overhead/np$np" --rounds 8 \
    --contenders local horovod:none hvdcomp:none hvdcomp:topk:density=0.01 hvdcomp:topk:density=0.01@bucket \
                 hvdcomp:dgc:density=0.01 hvdcomp:qsgd:levels=16 hvdcomp:terngrad hvdcomp:efsignsgd \
                 hvdcomp:randomk:density=0.01 hvdcomp:powersgd:matrix_rank=2 hvdcomp:fp16 hvdcomp:bf16 ) || status=1
done
fi
$PY mpi_scripts/report.py speed --e2e "$OUT/netem-e2e" --e2e-transformer "$OUT/netem-e2e-transformer" \
  --comm "$OUT/netem-comm" --kernels "$OUT/kernels-cpu" --overhead "$OUT/overhead" --output "$OUT" \
  --preamble benchmarks/speed_preamble.md
exit $status
