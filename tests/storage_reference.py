"""A one-process reference for tables with 16-bit rows (docs/storage.md): rows as a dict of
float32 arrays, the server optimizers' formulas in float32 exactly as csrc/ps/rules computes
them, and each updated row rounded into the row type by hybridsync.ps.storage.round_rows (to
nearest even, or stochastically from (seed, id, step)). The parity tests train real tables at
1, 2 and 3 ranks and compare every row bit for bit."""
from __future__ import annotations

import numpy as np

from hybridsync.ps.storage import round_rows, rounding_bits

F = np.float32


class HalfReference:
    def __init__(self, dtype: str, rule: str, hparams: dict, rounding: str = "nearest", seed: int = 0):
        self.dtype, self.rule, self.hp = dtype, rule, dict(hparams)
        self.stochastic, self.seed = rounding == "stochastic", seed
        self.rows, self.slots = {}, {}
        self.step = 0

    def add(self, ids, rows) -> None:
        """Rows that start from float32 `rows`, stored (rounded to nearest even) as a shard does."""
        for i, r in zip(np.asarray(ids).tolist(), round_rows(rows, self.dtype)):
            self.rows[i] = r
            init = F(self.hp.get("initial_accumulator_value", 0.0)) if self.rule == "adagrad" else F(0)
            n = {"sgd": 0, "adagrad": 1, "adam": 2}[self.rule]
            self.slots[i] = [np.full(len(r), init, F) for _ in range(n)]

    def push(self, ids, grads) -> None:
        """One round: the gradient rows of `ids` (duplicates summed) applied once per id."""
        self.step += 1
        t, hp = self.step, self.hp
        ids = np.asarray(ids, np.int64).reshape(-1)
        grads = np.asarray(grads, F).reshape(len(ids), -1)
        unique, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(unique), grads.shape[1]), F)
        np.add.at(summed, inverse, grads)
        out = np.empty_like(summed)
        for n, (i, g) in enumerate(zip(unique.tolist(), summed)):
            w, s = self.rows[i].copy(), self.slots[i]
            if self.rule == "sgd":
                w = w - F(hp["lr"]) * g
            elif self.rule == "adagrad":
                s[0] = s[0] + g * g
                clr = F(hp["lr"] / (1.0 + (t - 1) * hp.get("lr_decay", 0.0)))
                w = w - clr * (g / (np.sqrt(s[0]) + F(hp.get("eps", 1e-10))))
            else:
                b1, b2 = hp.get("beta1", 0.9), hp.get("beta2", 0.999)
                step_size = F(hp["lr"] * np.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t))
                s[0] = s[0] + (g - s[0]) * (F(1) - F(b1))
                s[1] = s[1] + (g * g - s[1]) * (F(1) - F(b2))
                w = w - step_size * (s[0] / (np.sqrt(s[1]) + F(hp.get("eps", 1e-8))))
            out[n] = w
        bits = rounding_bits(self.seed, t, unique, out.shape[1]) if self.stochastic else None
        for i, r in zip(unique.tolist(), round_rows(out, self.dtype, bits)):
            self.rows[i] = r

    def table(self, ids) -> np.ndarray:
        return np.stack([self.rows[i] for i in np.asarray(ids).tolist()])
