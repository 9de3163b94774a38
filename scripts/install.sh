#!/usr/bin/env bash
# Idempotent installer for hvdcomp.
#
# On a fresh Debian machine as root: installs Open MPI from Debian packages, makes a virtualenv
# (.venv by default), installs torch 2.13.0, numpy, mpi4py, pytest, Sphinx and the project, then builds
# Horovod 0.28.1 from its PyPI sdist with PyTorch + MPI + Gloo and caches the built wheel, so a
# second install skips the ~9 minute build. Finally compiles hvdcomp's native CPU kernels (C with
# OpenMP, a couple of seconds; optional: without a compiler the torch kernels are used).
#
# On an HPC login node without root: apt is skipped (the MPI already loaded with `module load`
# is used), and a torch that is already importable (e.g. a CUDA build) is kept.
#
# Without Horovod (HVDCOMP_HOROVOD=0): no Horovod build and no MPI needed; the DDP front-end
# (hvdcomp.ddp: torchrun / srun, torch.distributed over gloo or NCCL) is all that is checked. The
# Horovod front-end then raises an ImportError naming the fix.
#
# Environment overrides:
#   HVDCOMP_HOROVOD      1 (default): build Horovod and require MPI; 0: neither (DDP front-end only)
#   HVDCOMP_VENV         virtualenv path (default: <repo>/.venv)
#   HVDCOMP_SYSTEM_SITE  1: create the venv with --system-site-packages (to reuse a site torch)
#   HVDCOMP_WHEEL_CACHE  where built Horovod wheels are kept (default: ~/.cache/hvdcomp/wheels)
#   HVDCOMP_TORCH_SPEC   pip spec for torch when none is importable (default: torch==2.13.0)
#   HVDCOMP_BUILD_JOBS   parallel compile jobs for Horovod (default: number of cores)
#   HOROVOD_GPU_OPERATIONS=NCCL  build Horovod with GPU collectives (GPU nodes; part of the cache key)
#   CC                   C compiler for the native kernels (default: cc; needs OpenMP, e.g. gcc)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${HVDCOMP_VENV:-$ROOT/.venv}
CACHE=${HVDCOMP_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdcomp/wheels}
TORCH_SPEC=${HVDCOMP_TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
JOBS=${HVDCOMP_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}
WITH_HOROVOD=${HVDCOMP_HOROVOD:-1}
case "$WITH_HOROVOD" in 0|1) ;; *) echo "[install] error: HVDCOMP_HOROVOD must be 0 or 1, got '$WITH_HOROVOD'" >&2; exit 2 ;; esac

log() { printf '[install] %s\n' "$*"; }

# --- 1. MPI (for Horovod and mpi4py; not with HVDCOMP_HOROVOD=0) -----------------------------
if [ "$WITH_HOROVOD" = 0 ]; then
  log "HVDCOMP_HOROVOD=0: no MPI and no Horovod (the DDP front-end uses torch.distributed)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! dpkg -s openmpi-bin libopenmpi-dev libpmix-dev >/dev/null 2>&1; then
    log "installing Open MPI from Debian packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev libpmix-dev >/dev/null
  fi
else
  log "not root or no apt-get: using the MPI on PATH"
fi
if [ "$WITH_HOROVOD" = 1 ] && { ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; }; then
  echo "[install] error: mpicc/mpirun not found. Install Open MPI (as root: apt-get install" \
       "openmpi-bin libopenmpi-dev) or load your site's MPI module (module load openmpi); or install" \
       "without Horovod (HVDCOMP_HOROVOD=0: the DDP front-end only)." >&2
  exit 1
fi

# --- 2. virtualenv and Python packages -----------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  if [ "${HVDCOMP_SYSTEM_SITE:-0}" = 1 ]; then
    python3 -m venv --system-site-packages "$VENV"
  else
    python3 -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel packaging >/dev/null

if "$PY" -c 'import torch' >/dev/null 2>&1; then
  log "keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  log "installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
# the project and its runtime, test, docs (tests/test_docs.py builds them), plot and study
# (scikit-learn's digits) dependencies, and mpi4py for the Horovod front-end; torch is already
# satisfied above
if [ "$WITH_HOROVOD" = 1 ]; then
  "${PIP[@]}" -e "$ROOT[test,docs,plot,study,mpi]"
else
  "${PIP[@]}" -e "$ROOT[test,docs,plot,study]"
fi

# --- 3. Horovod, built once and cached ------------------------------------------------------
if [ "$WITH_HOROVOD" = 0 ]; then
  log "skipping Horovod (HVDCOMP_HOROVOD=0)"
elif "$PY" -c "import horovod.torch, sys; import horovod; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" >/dev/null 2>&1; then
  log "horovod $HOROVOD_VERSION already installed"
else
  PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  KEY="horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$PYTAG-gpu_${HOROVOD_GPU_OPERATIONS:-none}-$(mpicc --showme:version 2>/dev/null | tr -cd '[:alnum:].' | head -c 40)"
  WHEELDIR="$CACHE/$KEY"
  if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building horovod $HOROVOD_VERSION against torch $TORCH_VERSION (about 9 minutes on 2 cores)"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 in two places.
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    "${PIP[@]}" cloudpickle psutil pyyaml cffi
    mkdir -p "$WHEELDIR.tmp"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$JOBS" \
      "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELDIR.tmp" "$SRC"
    rm -rf "$WHEELDIR"; mv "$WHEELDIR.tmp" "$WHEELDIR"   # only a finished build enters the cache
  else
    log "using cached wheel $WHEELDIR"
  fi
  "${PIP[@]}" --force-reinstall --no-deps "$WHEELDIR"/horovod-*.whl
  "${PIP[@]}" cloudpickle psutil pyyaml cffi
fi

# --- 4. native CPU kernels (C + OpenMP, about 2 s; hvdcomp/native) ---------------------------
# Without a C compiler hvdcomp still works, with its torch kernels (slower on CPU).
log "building the native CPU kernels (hvdcomp/native, \$CC or cc)"
if ! "$PY" -m hvdcomp.native --build --check; then
  echo "[install] warning: native kernels not built; hvdcomp falls back to its torch kernels" >&2
fi

# --- 5. check --------------------------------------------------------------------------------
if [ "$WITH_HOROVOD" = 0 ]; then
  "$PY" -c 'import torch.distributed as d, hvdcomp.ddp; assert d.is_available() and d.is_gloo_available(), "torch.distributed with gloo is missing"' \
    || { echo "[install] error: the DDP front-end does not import (see above)" >&2; exit 1; }
  log "done (DDP front-end only: torchrun --nproc_per_node N mpi_scripts/train_lm.py --frontend ddp ...)"
  exit 0
fi
log "horovodrun --check-build:"
"$VENV/bin/horovodrun" --check-build | tee "$VENV/.horovod-check-build.txt"
grep -q '\[X\] PyTorch' "$VENV/.horovod-check-build.txt" && grep -q '\[X\] MPI' "$VENV/.horovod-check-build.txt" || {
  echo "[install] error: Horovod was built without PyTorch or MPI support (see above)" >&2; exit 1; }
log "done: activate with 'source $VENV/bin/activate'"
