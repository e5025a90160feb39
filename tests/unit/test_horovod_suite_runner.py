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


def test_lists_the_tests_parameterized_expand_makes_and_switches_every_suite_import(runner, tmp_path):
    source = ("import horovod.keras as hvd_keras\nimport horovod.tensorflow.keras as hvd\n"
              "from parameterized import parameterized\nimport unittest\n\n"
              "class Tf2KerasTests(unittest.TestCase):\n"
              "    @parameterized.expand([[True], [False]])\n    def test_agg(self, average):\n        assert average in (True, False)\n"
              "    def test_plain(self):\n        pass\n")
    assert runner.list_tests(source) == ["Tf2KerasTests::test_agg_0_True", "Tf2KerasTests::test_agg_1_False",
                                         "Tf2KerasTests::test_plain"]
    copy = runner.write_copy({"test_tensorflow2_keras.py": source}, False, tmp_path, runner.SUITES["keras"])
    text = copy.read_text()
    assert "import hybridsync.keras as hvd_keras" in text and "import hybridsync.tensorflow.keras as hvd" in text
    assert "horovod" not in text.replace("hybridsync", "")
    namespace = {}
    exec(compile((tmp_path / "parallel" / "parameterized.py").read_text(), "parameterized.py", "exec"), namespace)
    tests = {}
    exec("class T:\n    @parameterized.expand([[True], [False]])\n    def test_agg(self, average):\n        return average\n",
         {"parameterized": namespace["parameterized"]}, tests)
    assert [tests["T"]().test_agg_0_True(), tests["T"]().test_agg_1_False()] == [True, False]


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


def test_a_tensorflow_test_whose_graph_and_eager_subtests_were_all_skipped_counts_as_skipped(runner):
    gpu_only = "[1,0]<stdout>:1 passed, 2 skipped in 13.07s\n[1,1]<stdout>:1 passed, 2 skipped in 13.1s\n"
    assert runner.classify(0, gpu_only, 2) == "skipped"
    eager_only = ("[1,0]<stdout>:1 passed, 1 skipped, 1 subtests passed in 7.3s\n"
                  "[1,1]<stdout>:1 passed, 1 skipped, 1 subtests passed in 7.4s\n")
    assert runner.classify(0, eager_only, 2) == "passed"
    both = "[1,0]<stdout>:1 passed, 2 subtests passed in 10.1s\n[1,1]<stdout>:1 passed, 2 subtests passed in 10.0s\n"
    assert runner.classify(0, both, 2) == "passed"
    graph_failed = "[1,0]<stdout>:1 failed, 1 subtests passed in 9.0s\n[1,1]<stdout>:1 failed, 1 subtests passed in 9s\n"
    assert runner.classify(1, graph_failed, 2) == "failed"
