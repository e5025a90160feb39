"""The examples train: their loss falls when run as a user would, under mpirun -np 2."""
import re

from tests.parallel.harness import run_program


def _losses(out):
    return [float(x) for x in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", out)]


def test_dlrm_sharded_loss_falls_and_plan_and_auto_decision_are_printed():
    """What `make demo` shows: the plan at step 1 (tables measuring for `sync: auto`), then, on
    rank 0 only and without HYBRIDSYNC_EXPLAIN, the route auto chose for every table."""
    out = run_program(2, "examples/torch_dlrm.py", "--rows", "20000", "--steps", "200", "--log-every", "50",
                      env={"HYBRIDSYNC_EXPLAIN": "0"})
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out
    lines = out.splitlines()
    plan = [line for line in lines if "embeddings.0.weight" in line]
    assert plan and "ps" in plan[0] and "sharded" in plan[0] and "adagrad" in plan[0], out
    measuring = [i for i, line in enumerate(lines) if "embeddings.7.weight: measuring (20 steps on ps" in line]
    decided = [i for i, line in enumerate(lines) if "sync: auto decided at step 20:" in line]
    assert len(measuring) == 1 and len(decided) == 1 and measuring[0] < decided[0], out
    assert lines[decided[0]].startswith("[1,0]<stdout>:"), out  # rank 0's
    rows = [line.split(":", 1)[1].split() for line in lines[decided[0] + 1:decided[0] + 11]]
    assert rows[0][:3] == ["variable", "route", "shards"], out
    assert [r[0] for r in rows[2:]] == [f"embeddings.{k}.weight" for k in range(8)], out
    for cells in rows[2:]:  # route, shards (PS only), density; the choice itself is test_auto_strategy's
        assert cells[1] in ("ps", "allgather", "allreduce-as-dense"), cells
        assert (cells[2] in ("1", "2")) if cells[1] == "ps" else cells[2] == "-", cells
        assert cells[3].endswith("%"), cells


def test_dlrm_replicated_loss_falls():
    out = run_program(2, "examples/torch_dlrm.py", "--rows", "20000", "--steps", "200", "--log-every", "50",
                      "--placement", "replicated")
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out


def test_dlrm_checkpoints_and_resumes_at_another_world_size(tmp_path):
    ckpt = str(tmp_path / "dlrm")
    common = ["examples/torch_dlrm.py", "--rows", "20000", "--log-every", "50", "--checkpoint", ckpt,
              "--checkpoint-every", "50"]
    first = _losses(run_program(2, *common, "--steps", "100"))
    out = run_program(3, *common, "--steps", "150")
    assert "resumed from" in out and "at step 100 on 3 rank(s)" in out, out
    resumed = _losses(out)
    assert len(resumed) == 1 and resumed[0] < 0.9 * first[0], (first, out)  # kept what it had learnt


def test_horovod_pytorch_mnist_example_runs_unchanged_but_for_the_import():
    """examples/torch_horovod_mnist.py is Horovod's PyTorch MNIST script in its own shape
    (DistributedSampler, broadcasts, DistributedOptimizer options, averaged test metrics)."""
    out = run_program(2, "examples/torch_horovod_mnist.py", "--epochs", "3", "--train-samples", "4096",
                      "--test-samples", "512", "--fp16-allreduce", "--gradient-predivide-factor", "2")
    results = [(float(loss), float(acc)) for loss, acc in
               re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", out)]
    assert len(results) == 3, out  # printed by rank 0 only
    assert results[-1][0] < 0.9 * results[0][0] and results[-1][1] > 50, out


def test_the_everything_example_trains_skips_a_nan_step_and_resumes_at_another_world_size(tmp_path):
    """examples/torch_everything.py: every feature in one model (the composition test's, as a
    user would write it), at 2 ranks, then resumed from its checkpoint at 3."""
    ckpt = str(tmp_path / "everything")
    common = ["examples/torch_everything.py", "--checkpoint", ckpt, "--samples", "2048", "--batch-size", "128"]
    out = run_program(2, *common, "--epochs", "2")
    losses = [float(x) for x in re.findall(r"epoch \d+  loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out
    assert "the gradients are not finite, the step is skipped" in out and "non-finite steps left out" in out, out
    out = run_program(3, *common, "--epochs", "3")
    assert "resumed at epoch 2 on 3 rank(s)" in out, out
    resumed = [float(x) for x in re.findall(r"epoch \d+  loss ([0-9.]+)", out)]
    assert len(resumed) == 1 and resumed[0] < losses[0], (losses, out)
