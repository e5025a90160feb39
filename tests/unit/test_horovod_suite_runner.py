"""scripts/horovod_suite.py's parsing, on made-up inputs (running it needs Horovod's repository)."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "horovod_suite.py"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("horovod_suite", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE = '''import os
import unittest

import horovod.torch as hvd

class TorchTests(unittest.TestCase):
    def test_a(self):
        pass

    def helper(self):
        pass

    def test_b(self):
        pass

class NotATestCase:
    def test_c(self):
        pass
'''


def test_lists_test_methods_of_test_cases_only(runner):
    assert runner.list_tests(SOURCE) == ["TorchTests::test_a", "TorchTests::test_b"]


def test_the_copy_differs_only_in_its_import_line(runner, tmp_path):
    copy = runner.write_copy(SOURCE, real_horovod=False, workdir=tmp_path)
    assert copy.read_text() == SOURCE.replace("import horovod.torch as hvd", "import hybridsync.torch as hvd")
    assert (tmp_path / "utils" / "common.py").exists()  # where test_torch.py's sys.path line looks
    assert runner.write_copy(SOURCE, real_horovod=True, workdir=tmp_path / "real").read_text() == SOURCE
    with pytest.raises(SystemExit, match="exactly one line"):
        runner.write_copy("import os\n", real_horovod=False, workdir=tmp_path / "bad")


def test_classifies_each_ranks_summary_even_when_their_output_interleaves(runner):
    both_passed = "[1,0]<stdout>:.[1,1]<stdout>:1 passed in 3.82s\n[1,0]<stdout>:1 passed, 2 warnings in 3.9s\n"
    assert runner.classify(0, both_passed, 2) == "passed"
    skipped = "[1,0]<stdout>:   [100%][1,1]<stdout>:1 skipped in 3.48s\n[1,0]<stdout>:1 skipped in 3.54s\n"
    assert runner.classify(0, skipped, 2) == "skipped"
    one_failed = "[1,0]<stdout>:1 failed in 4.6s\n[1,1]<stdout>:1 passed in 4.1s\n"
    assert runner.classify(1, one_failed, 2) == "failed"
    assert runner.classify(1, "[1,0]<stdout>:1 passed in 4.1s\n", 2) == "failed"  # rank 1 never reported
    mixed = "[1,0]<stdout>:1 skipped in 1.0s\n[1,1]<stdout>:1 passed in 1.0s\n"
    assert runner.classify(0, mixed, 2) == "failed"
    assert runner.classify(134, both_passed, 2) == "failed"  # crashed at exit
