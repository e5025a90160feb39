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
