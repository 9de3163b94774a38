# Shared by the untimed local-update run.sh scripts in this folder (source it; not a script).
# Sets the launch environment from hvdcomp/mpi.env (its one definition) with the netem benchmark's
# Horovod cycle time (20 ms), and defines run NAME PROGRAM ARGS...: PROGRAM (a train_lm.py-style
# script) on $NP ranks of this machine (default 4), writing $OUT/NAME/ and $OUT/NAME.log; PROGRAM's arguments are
# ARGS then --output $OUT/NAME. Needs OUT set; PYTHON overrides the interpreter (.venv/bin/python).
# TRANSFORMER: train_lm.py with the small transformer settings the untimed transformer runs share
# (AdamW, weight decay 0.1, clip 1.0, 29 warm-up steps, then a constant lr, seed 1); each run.sh
# adds --lr, --epochs and --compressor.
PY=${PYTHON:-.venv/bin/python}
set -a; . hvdcomp/mpi.env; set +a
export HOROVOD_CYCLE_TIME=20
TRANSFORMER="mpi_scripts/train_lm.py --arch transformer --model small --optimizer adamw --weight-decay 0.1 --clip 1.0 --warmup-steps 29 --anneal 1 --seed 1 --no-progress"
run() {
  local name=$1 program=$2; shift 2
  timeout 1200 mpirun -n "${NP:-4}" --oversubscribe -x HOROVOD_CYCLE_TIME -x OMPI_MCA_mpi_yield_when_idle -x OMP_NUM_THREADS \
    -x PYTHONUNBUFFERED "$PY" $program "$@" --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
}
