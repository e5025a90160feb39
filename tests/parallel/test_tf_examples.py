"""The TensorFlow example trains under mpirun -np 2: its loss falls, the embeddings on the PS."""
import re

from tests.parallel.harness import run_program


def test_tf_wide_deep_loss_falls():
    out = run_program(2, "examples/tf_wide_deep.py", "--epochs", "3", "--samples", "8000", "--vocab", "5000",
                      timeout=300)
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.9 * losses[0], out
    row = next(line for line in out.splitlines() if "deep/embeddings " in line)
    # Plain keras.layers.Embedding tables, moved onto the shards when Horovod's callback hands the model over.
    assert " ps " in row and "sharded" in row and "adagrad" in row and "keras.layers.Embedding moved" in row, row


def test_tf_wide_deep_with_ps_embeddings_loss_falls():
    out = run_program(2, "examples/tf_wide_deep.py", "--epochs", "3", "--samples", "8000", "--vocab", "5000",
                      "--ps-embeddings", timeout=300)
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.9 * losses[0], out
    row = next(line for line in out.splitlines() if "deep/embeddings " in line)
    assert " ps " in row and "sharded" in row, row
