"""Projection to large clusters: bytes each rank sends per step, Horovod allgather vs the PS.

A MODEL, not a measurement. It counts payload bytes from unique-row statistics sampled from the
benchmark's own id distribution (Zipf(1.2) mod rows), for N = 2 ... 512 ranks:

  Horovod allgather   every rank receives and forwards every other rank's sparse gradient:
                      (N - 1) * batch * (4*dim + 8) per table (values + int64 indices)
  PS sharded          rows it needs from other shards, pushed back as gradients, plus the
                      rows other ranks need from its shard; ids ride along:
                      U(batch) * (N-1)/N * (2 * 4*dim + 16) per table
  PS replicated       its gradients out, plus every changed row of its shard to every rank:
                      U(batch)*(N-1)/N*(4*dim + 8) + U(N*batch)*(N-1)/N*(4*dim + 8) per table

U(n) is the expected number of distinct ids among n samples. The dense all-reduce is the same for
every system and left out. Measured PS bytes from benchmarks/results/latest.json (2 and 4 ranks)
are drawn on top, to check the model against reality.

    python benchmarks/model.py      # writes benchmarks/results/projection.{json,png}
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
TABLES, ROWS, DIM, BATCH = 8, 250_000, 32, 512
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512]


def unique_rows(n: int, trials: int = 3, seed: int = 0) -> float:
    """Expected distinct ids among n Zipf(1.2) samples mod ROWS."""
    rng = np.random.default_rng(seed)
    return float(np.mean([len(np.unique(rng.zipf(1.2, n) % ROWS)) for _ in range(trials)]))


def project():
    row = 4 * DIM
    u_local = unique_rows(BATCH)
    out = []
    for n in RANKS:
        remote = (n - 1) / n
        u_global = unique_rows(n * BATCH, trials=1)
        out.append({
            "ranks": n,
            "horovod_allgather": TABLES * (n - 1) * BATCH * (row + 8),
            "ps_sharded": TABLES * u_local * remote * (2 * row + 16),
            "ps_replicated": TABLES * (u_local * remote * (row + 8) + u_global * remote * (row + 8)),
            "unique_local": u_local,
            "unique_global": u_global,
        })
    return out


def measured():
    path = RESULTS / "latest.json"
    if not path.exists():
        return []
    summary = json.loads(path.read_text()).get("summary", [])
    return [(s["system"], s["ranks"], s["ps_bytes_sent"]) for s in summary
            if s["system"].startswith("hybridsync") and s["ps_bytes_sent"] and s["ranks"] > 1]


def main():
    rows = project()
    points = measured()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "projection.json").write_text(json.dumps({"model": rows, "measured": points}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ranks = [r["ranks"] for r in rows]
    for key, label in (("horovod_allgather", "Horovod allgather (model)"), ("ps_replicated", "hybridsync replicated (model)"),
                       ("ps_sharded", "hybridsync sharded (model)")):
        ax.plot(ranks, [r[key] / 2**20 for r in rows], marker="o", label=label)
    for system, n, sent in points:
        ax.scatter([n], [sent / 2**20], marker="x", s=70, color="black" if "sharded" in system else "gray",
                   label=f"{system} measured", zorder=5)
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="MiB sent per rank per step",
           title="Projection (a model from measured unique-row statistics, not a measurement)")
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, l in zip(handles, labels):
        seen.setdefault(l, h)
    ax.legend(seen.values(), seen.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "projection.png", dpi=110)

    print("MODEL (not a measurement): MiB sent per rank per step, payload only")
    print(f"{'ranks':>6} {'Horovod allgather':>18} {'PS replicated':>14} {'PS sharded':>11} {'allgather/sharded':>18}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['horovod_allgather'] / 2**20:>18.2f} {r['ps_replicated'] / 2**20:>14.2f} "
              f"{r['ps_sharded'] / 2**20:>11.2f} {r['horovod_allgather'] / r['ps_sharded']:>17.0f}x")
    for system, n, sent in points:
        model = next(r for r in rows if r["ranks"] == n)["ps_sharded" if "sharded" in system else "ps_replicated"]
        print(f"measured {system} at {n} ranks: {sent / 2**20:.3f} MiB (model {model / 2**20:.3f} MiB)")
    print(f"wrote {RESULTS / 'projection.json'} and projection.png")


if __name__ == "__main__":
    main()
