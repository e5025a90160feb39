import os
import sys
from pathlib import Path

# Tests import `tests.parallel.harness` and the package from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# mpirun as root (CI containers) needs these; harmless otherwise.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
