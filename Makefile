# hybridsync — everything installs into .venv/ on first use (scripts/install.sh; idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
# mpirun refuses to run as root without these (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install demo test test-unit test-parallel bench clean

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

clean:
	rm -rf build hybridsync/_ps*.so
