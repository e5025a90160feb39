"""A one-process reference for dynamic tables: a Python dict of rows per shard with the rules of
docs/dynamic-tables.md (admission, LRU/LFU eviction to 7/8 of the shard's share, ttl expiry)
and the server optimizers' formulas, in float64. The parity tests train the real tables at
1, 2 and 3 ranks and compare every id's row with this."""
from __future__ import annotations

import numpy as np

from hybridsync.ps import dynamic_options as dyn


class ReferenceTable:
    def __init__(self, dim, shards=1, capacity=None, admit_after=1, evict=None, ttl_steps=None, seed=0,
                 initializer=("normal", 0.0, 1.0), rule=("sgd", {"lr": 0.1})):
        self.dim, self.shards, self.capacity = dim, shards, capacity
        self.admit_after, self.evict, self.ttl = admit_after, evict, ttl_steps
        self.seed, self.initializer = seed, initializer
        self.rule, self.hp = rule[0], dict(rule[1])
        self.step = 0
        self.shard = [dict(rows={}, slots={}, count={}, last={}, pending={}) for _ in range(shards)]
        self.admitted = self.evicted = self.expired = 0

    def initial(self, i):
        return dyn.initial_rows(self.seed, np.array([i], np.int64), self.dim, self.initializer)[0].astype(np.float64)

    def row(self, i):
        s = self.shard[int(dyn.hash_shard([i], self.shards)[0])]
        return s["rows"][i] if i in s["rows"] else self.initial(i)

    def rows(self, ids):
        """row(i) of every id, with the hash and the initial values computed in one pass."""
        ids = np.asarray(ids, np.int64)
        out = dyn.initial_rows(self.seed, ids, self.dim, self.initializer).astype(np.float64)
        for n, (i, k) in enumerate(zip(ids.tolist(), dyn.hash_shard(ids, self.shards))):
            stored = self.shard[int(k)]["rows"].get(i)
            if stored is not None:
                out[n] = stored
        return out

    def stored_ids(self):
        return sorted(i for s in self.shard for i in s["rows"])

    def push(self, grads: dict):
        """One round: {id: summed, scaled gradient row}."""
        self.step += 1
        t = self.step
        by_shard = [{} for _ in range(self.shards)]
        shard_of = dyn.hash_shard(np.fromiter(grads, np.int64, len(grads)), self.shards)
        for (i, g), k in zip(grads.items(), shard_of):
            by_shard[int(k)][i] = np.asarray(g, np.float64)
        for k, s in enumerate(self.shard):
            self._shard_step(s, by_shard[k], t, dyn.capacity_share(self.capacity, self.shards, k))

    def _shard_step(self, s, grads, t, share):
        rows, count, last, pending = s["rows"], s["count"], s["last"], s["pending"]
        candidates, touched_stored = [], 0
        for i in grads:
            if i in rows:
                count[i] += 1
                last[i] = t
                touched_stored += 1
                continue
            c = pending.get(i, (0, 0))[0] + 1
            if c >= self.admit_after:
                candidates.append((i, c))
            else:
                pending[i] = (c, t)
        if self.ttl:
            for i in [i for i in rows if t - last[i] > self.ttl]:
                self._remove(s, i)
                self.expired += 1
            for i in [i for i, (_, seen) in pending.items() if t - seen > self.ttl]:
                del pending[i]
        if share and len(rows) + len(candidates) > share and self.evict:
            low = share - share // 8
            untouched = [i for i in rows if last[i] != t]
            key = ((lambda i: (count[i], last[i], i)) if self.evict == "lfu" else (lambda i: (last[i], i)))
            k = min(len(rows) + len(candidates) - low, len(untouched))
            for i in sorted(untouched, key=key)[:max(k, 0)]:
                self._remove(s, i)
                self.evicted += 1
        room = share - len(rows) if share else len(candidates)
        candidates.sort()
        admitted = np.array([i for i, _ in candidates[:max(room, 0)]], np.int64)
        initial = dyn.initial_rows(self.seed, admitted, self.dim, self.initializer).astype(np.float64)
        for n, (i, c) in enumerate(candidates):
            if n < room:
                pending.pop(i, None)
                rows[i] = initial[n]
                s["slots"][i] = self._fresh_slots()
                count[i], last[i] = c, t
                self.admitted += 1
            else:
                pending[i] = (c, t)
        for i, g in grads.items():
            if i in rows:
                self._apply(rows, s["slots"], i, g, t)

    def _remove(self, s, i):
        for key in ("rows", "slots", "count", "last"):
            del s[key][i]

    def _fresh_slots(self):
        init = self.hp.get("initial_accumulator_value", 0.0) if self.rule == "adagrad" else 0.0
        n = {"sgd": 0, "adagrad": 1, "adam": 2}[self.rule]
        return [np.full(self.dim, init) for _ in range(n)]

    def _apply(self, rows, slots, i, g, t):
        hp, w = self.hp, rows[i]
        if self.rule == "sgd":
            rows[i] = w - hp["lr"] * g
        elif self.rule == "adagrad":
            acc = slots[i][0] + g * g
            slots[i][0] = acc
            clr = hp["lr"] / (1.0 + (t - 1) * hp.get("lr_decay", 0.0))
            rows[i] = w - clr * (g / (np.sqrt(acc) + hp.get("eps", 1e-10)))
        else:
            b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("eps", 1e-8)
            m = slots[i][0] + (g - slots[i][0]) * (1 - b1)
            v = slots[i][1] + (g * g - slots[i][1]) * (1 - b2)
            slots[i][0], slots[i][1] = m, v
            step_size = hp["lr"] * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            rows[i] = w - step_size * (m / (np.sqrt(v) + eps))
