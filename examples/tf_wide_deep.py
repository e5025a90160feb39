"""Wide & Deep (Keras 3 / TensorFlow) on synthetic CTR data, trained with hybridsync.

The embedding tables' rows live on the parameter server's shards: plain keras.layers.Embedding
tables are moved there when Horovod's BroadcastGlobalVariablesCallback hands the model to the
DistributedOptimizer (--ps-embeddings builds them as hybridsync.tensorflow.Embedding instead);
each row is updated once per step on the shard that owns it. The dense layers are all-reduced.

    mpirun -np 2 python examples/tf_wide_deep.py                # as root: mpirun --allow-run-as-root
    mpirun -np 2 python examples/tf_wide_deep.py --config hybridsync.yaml
"""
from __future__ import annotations

import argparse

import numpy as np

FEATURES, DENSE = 4, 8


def make_data(n, vocab, seed):
    """Dense features, categorical ids (Zipf-like), and labels from a fixed seeded teacher."""
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(1234)
    dense_w = teacher.standard_normal(DENSE).astype(np.float32)
    id_score = teacher.standard_normal((FEATURES, vocab)).astype(np.float32)
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    ids = (rng.zipf(1.3, (n, FEATURES)) % vocab).astype(np.int64)
    logit = dense @ dense_w / np.sqrt(DENSE) + id_score[np.arange(FEATURES), ids].mean(1) * 2.0
    return dense, ids, (logit > 0).astype(np.float32)[:, None]


def build_model(vocab, dim, ps_embeddings=False):
    import keras

    import hybridsync.tensorflow as hvd

    # ps_embeddings: tables whose rows live only on the PS shards (each rank holds 1/N).
    embedding = hvd.Embedding if ps_embeddings else keras.layers.Embedding
    dense_in = keras.Input(shape=(DENSE,), name="dense")
    ids_in = keras.Input(shape=(FEATURES,), dtype="int64", name="ids")
    wide = keras.layers.Flatten()(embedding(vocab, 1, name="wide")(ids_in))  # a weight per id
    deep = keras.layers.Flatten()(embedding(vocab, dim, name="deep")(ids_in))
    x = keras.layers.Concatenate()([deep, dense_in])
    x = keras.layers.Dense(64, activation="relu", name="mlp_1")(x)
    x = keras.layers.Dense(32, activation="relu", name="mlp_2")(x)
    logit = keras.layers.Add()([keras.layers.Dense(1, name="deep_out")(x),
                                keras.layers.Dense(1, name="wide_out")(wide)])
    return keras.Model([dense_in, ids_in], logit)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=40_000, help="per rank, per epoch")
    parser.add_argument("--batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--vocab", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--config", default=None, help="YAML config with per-variable overrides")
    parser.add_argument("--ps-embeddings", action="store_true",
                        help="hybridsync.tensorflow.Embedding: rows only on the PS shards (sharded placement)")
    args = parser.parse_args()

    import keras

    import hybridsync
    import hybridsync.tensorflow as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = build_model(args.vocab, args.dim, args.ps_embeddings)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adagrad(args.lr), config=args.config)
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  jit_compile=False)  # hybridsync's collectives are Python ops, which XLA cannot compile
    dense, ids, label = make_data(args.samples, args.vocab, seed=hvd.rank())
    history = model.fit(
        {"dense": dense, "ids": ids}, label, batch_size=args.batch_size, epochs=args.epochs, shuffle=False,
        verbose=0, callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])
    if hvd.rank() == 0:
        hybridsync.explain()
        for epoch, loss in enumerate(history.history["loss"]):
            print(f"epoch {epoch}: loss {loss:.4f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
