# hybridsync — everything installs into .venv/ on first use (scripts/install.sh; idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
# mpirun refuses to run as root without these (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install demo test test-unit test-parallel bench bench-network bench-quick bench-kernels bench-keras torchrec-venv clean

install:
	@bash scripts/install.sh

demo: install
	$(VENV)/bin/horovodrun -np 2 $(PY) examples/torch_dlrm.py

# Two pytest workers, each taking whole files (a file's module fixtures, its fixed paths and its
# netns cluster stay in one process): the launches of one overlap the waits of the other.
test: install
	$(PY) -m pytest tests -n 2 --dist loadfile

test-unit: install
	$(PY) -m pytest tests/unit

test-parallel: install
	$(PY) -m pytest tests/parallel -n 2 --dist loadfile

# Side-by-side benchmark, TorchRec included (about 40 minutes, then an hour for the network mode): table, JSON and
# plots in benchmarks/results/, docs/performance.md's tables and the README's headline table updated; then the
# large-cluster projection (a model).
bench: install torchrec-venv
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/network.py
	$(PY) benchmarks/headline.py
	$(PY) benchmarks/model.py

# Only the network mode (2 emulated hosts x 1 and x 2 ranks, unlimited / 10 Gbit / 1 Gbit; needs root).
bench-network: install torchrec-venv
	$(PY) benchmarks/network.py
	$(PY) benchmarks/headline.py
	$(PY) benchmarks/model.py

# The PS kernels against STREAM copy / triad on one pinned core, and their cache misses per row (valgrind).
bench-kernels: install
	$(PY) benchmarks/kernels.py --cachegrind

# Keras 3: TensorFlow's MultiWorkerMirroredStrategy and ParameterServerStrategy next to hybridsync.
bench-keras: install
	$(PY) benchmarks/keras_side_by_side.py

# TorchRec for CPU in a venv of its own (~/.cache/hybridsync/torchrec-venv), the baseline bench.py runs.
torchrec-venv:
	@bash scripts/torchrec-venv.sh > /dev/null

bench-quick: install
	$(PY) benchmarks/bench.py --quick

clean:
	rm -rf build hybridsync/_ps*.so hybridsync/_liveness*.so hybridsync/libhybridsync_ps.so
