# hvdcomp: the two commands a newcomer needs are `make run` and `make test`.
# Both install first (idempotent: a second install takes seconds, Horovod's wheel is cached).

VENV      ?= .venv
PY        := $(VENV)/bin/python
NP        ?= 4
COMPRESSOR?= topk:density=0.01
MODEL     ?= small
EPOCHS    ?= 1
DATA      ?= ../shared/data/tinyshakespeare/input.txt
FRONTEND  ?= horovod
OUTPUT    ?= runs/$(subst :,_,$(subst =,-,$(subst $(comma),_,$(COMPRESSOR))))-np$(NP)$(if $(filter ddp,$(FRONTEND)),-ddp)
comma     := ,

# Open MPI settings used for every run (ranks may outnumber cores; root is allowed in containers):
# their one definition is hvdcomp/mpi.env (also read by hvdcomp.launch.MPI_ENV and the scripts).
include hvdcomp/mpi.env
export $(shell sed -n 's/^\([A-Z_]*\)=.*/\1/p' hvdcomp/mpi.env)

STUDY_OUT ?= docs/results/study-small

.PHONY: install run test study study-v1 speed speed-local numerics clean

install: $(VENV)/.hvdcomp-installed

$(VENV)/.hvdcomp-installed: scripts/install.sh setup.cfg pyproject.toml
	HVDCOMP_VENV=$(abspath $(VENV)) HVDCOMP_HOROVOD=$(if $(HVDCOMP_HOROVOD),$(HVDCOMP_HOROVOD),1) bash scripts/install.sh
	touch $@

# FRONTEND=ddp: the same run on DistributedDataParallel + hvdcomp's comm hook, started by torchrun
run: install
ifeq ($(FRONTEND),ddp)
	$(VENV)/bin/torchrun --nproc_per_node $(NP) mpi_scripts/train_lm.py --frontend ddp \
	  --compressor '$(COMPRESSOR)' --model $(MODEL) --epochs $(EPOCHS) --data '$(DATA)' --output '$(OUTPUT)'
else
	mpirun -np $(NP) --oversubscribe --bind-to none $(PY) mpi_scripts/train_lm.py \
	  --compressor '$(COMPRESSOR)' --model $(MODEL) --epochs $(EPOCHS) --data '$(DATA)' --output '$(OUTPUT)'
endif

test: install
	$(PY) -m pytest -v --durations=40 tests

# Study v2 (issue 18): the seed study's claims at 4 ranks, trained to convergence with a learning-rate
# search and three seeds, within an 8-hour budget on 2 cores; then AB-training's CNN on the digits
# (about 10 minutes). Resumable: finished cells are kept; STUDY_CHUNK=3600 starts no new cell after
# an hour, so the study can run in chunks (rerun the same command to continue).
STUDY_CHUNK ?= 0
study: install
	$(PY) mpi_scripts/sweep.py mpi_scripts/grids/study_v2.yaml --stop-after $(STUDY_CHUNK)
	$(PY) mpi_scripts/report.py docs/results/study-v2 --grid mpi_scripts/grids/study_v2.yaml \
	  --budget-hours 8 --command 'make study'
	$(PY) mpi_scripts/sweep.py mpi_scripts/grids/ab_digits.yaml
	$(PY) mpi_scripts/report.py ab docs/results/study-v2-ab --grid mpi_scripts/grids/ab_digits.yaml \
	  --command 'make study'

# The first study (2 epochs per cell, one seed, lr 20; small model at 1/2/4 ranks, low-rank and
# related-work methods), kept for comparison: about 1.5-2 hours on 2 cores.
study-v1: install
	$(PY) mpi_scripts/sweep.py mpi_scripts/grids/study_small.yaml --output '$(STUDY_OUT)' --data '$(DATA)'
	$(PY) mpi_scripts/sweep.py mpi_scripts/grids/lowrank_small.yaml --output '$(STUDY_OUT)' --data '$(DATA)'
	$(PY) mpi_scripts/sweep.py mpi_scripts/grids/related_small.yaml --output '$(STUDY_OUT)' --data '$(DATA)'
	$(PY) mpi_scripts/report.py '$(STUDY_OUT)' --command 'make study-v1' \
	  --grid mpi_scripts/grids/study_small.yaml mpi_scripts/grids/lowrank_small.yaml mpi_scripts/grids/related_small.yaml

# The speed benchmarks (root: network namespaces; about 1.7 hours on 2 cores), then the report.
speed: install
	bash docs/results/speed/run.sh docs/results/speed

# Issue 32's local-update grid (root: network namespaces; about 3.7 hours on 2 cores for both workloads
# at 10 and 100 Mbit/s): LOCAL_WORKLOADS / LOCAL_RATES pick a part, e.g. LOCAL_WORKLOADS=lstm LOCAL_RATES=10mbit.
LOCAL_OUT       ?= runs/local-update
LOCAL_WORKLOADS ?= lstm transformer
LOCAL_RATES     ?= 10mbit 100mbit
speed-local: install
	bash docs/results/local-update/run.sh '$(LOCAL_OUT)' '$(LOCAL_WORKLOADS)' '$(LOCAL_RATES)'

clean:
	rm -rf runs .pytest_cache

# The extreme-input matrix (tests/test_numerics_matrix.py, ~1 minute on 2 cores), rendered into docs/numerics.md.
numerics: install
	mkdir -p runs
	HVDCOMP_NUMERICS_JSON=$(abspath runs/numerics.json) $(PY) -m pytest -q tests/test_numerics_matrix.py
	$(PY) scripts/numerics_table.py runs/numerics.json docs/numerics.md
