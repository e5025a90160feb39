"""The examples train: their loss falls when run as a user would, under mpirun -np 2."""
import re

from tests.parallel.harness import run_program


def _losses(out):
    return [float(x) for x in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", out)]


def test_dlrm_sharded_loss_falls_and_plan_is_printed():
    out = run_program(2, "examples/torch_dlrm.py", "--rows", "20000", "--steps", "200", "--log-every", "50")
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out
    plan = [line for line in out.splitlines() if "embeddings.0.weight" in line]
    assert plan and "ps" in plan[0] and "sharded" in plan[0] and "adagrad" in plan[0], out


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
