#!/bin/bash
# Is the LSTM's trajectory set by the machine's math-kernel paths? (2026-12-05, untimed)
# The netem grid's baseline cell (sync|fp16@ring, seed 1), cut to one epoch, on 4 ranks of this
# machine without emulated links, once as is and once per forced instruction-set path of MKL,
# ATen and oneDNN; prints each run's epoch-1 validation perplexity. Deterministic: load does not
# change the values. Run from the project root: bash docs/results/local-update/kernel-paths/run.sh
set -u
OUT=${OUT:-runs/kernel-paths}; mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
set -a; . hvdcomp/mpi.env; set +a
export HOROVOD_CYCLE_TIME=20 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
run() { local name=$1; shift
  env "$@" timeout 600 mpirun -n 4 --oversubscribe --bind-to none -x HOROVOD_CYCLE_TIME -x OMPI_MCA_mpi_yield_when_idle \
    -x OMP_NUM_THREADS -x PYTHONUNBUFFERED -x OMPI_MCA_coll_tuned_allreduce_algorithm=4 -x OMPI_MCA_coll_tuned_use_dynamic_rules=1 \
    -x ATEN_CPU_CAPABILITY -x MKL_ENABLE_INSTRUCTIONS -x MKL_CBWR -x ONEDNN_MAX_CPU_ISA \
    "$PY" benchmarks/local_lm.py --contender 'sync|fp16@ring' --arch lstm --model small --lr 20 --epochs 15 --warmup-steps 29 \
    --anneal 4 --min-improvement 0.01 --early-stop 2 --min-epochs 6 --compressor fp16 --seed 1 --epochs 1 \
    --output "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? epoch-1 $("$PY" -c "import json,sys; print(repr(json.load(open(sys.argv[1]))['train_lm']['epochs'][0]['val_ppl']))" "$OUT/$name.json" 2>/dev/null)"
}
run as-is
run aten-avx2 ATEN_CPU_CAPABILITY=avx2
run mkl-avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
run mkl-cbwr-avx2 MKL_CBWR=AVX2
run aten-and-mkl-avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
run mkl-avx512 MKL_ENABLE_INSTRUCTIONS=AVX512
run onednn-avx512-core ONEDNN_MAX_CPU_ISA=AVX512_CORE
run onednn-avx2 ONEDNN_MAX_CPU_ISA=AVX2
