# hybridsync — everything installs into .venv/ on first use (scripts/install.sh; idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
# mpirun refuses to run as root without these (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install demo test test-unit test-parallel bench bench-network bench-quick clean

install:
	@bash scripts/install.sh

demo: install
	$(VENV)/bin/horovodrun -np 2 $(PY) examples/torch_dlrm.py

test: install
	$(PY) -m pytest tests

test-unit: install
	$(PY) -m pytest tests/unit

test-parallel: install
	$(PY) -m pytest tests/parallel

# Side-by-side benchmark (about 25 minutes, then 30 for the network mode): table, JSON and plots in benchmarks/results/,
# docs/performance.md's tables updated; then the large-cluster projection (a model).
bench: install
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/network.py
	$(PY) benchmarks/model.py

# Only the network mode (2 emulated hosts x 1 and x 2 ranks, unlimited / 10 Gbit / 1 Gbit; needs root).
bench-network: install
	$(PY) benchmarks/network.py
	$(PY) benchmarks/model.py

bench-quick: install
	$(PY) benchmarks/bench.py --quick

clean:
	rm -rf build hybridsync/_ps*.so
