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

Calibrated step time (when benchmarks/results/network.json exists, from `make bench-network`):

  t(system, ranks, link) = a_system + c_system * (oversubscription - 1) + b * wire_bytes_per_host / link_rate

  c_system   compute of one step, measured: the system on 1 rank with no network (same run)
  a_system   fitted: the step at 2 hosts x 1 rank with no link limit (compute + latency + protocol)
  b          fitted, shared by every system: 1 / the fraction of a link's nominal rate TCP achieves
  wire bytes measured from the host links' counters

fitted on 2 hosts x 1 rank (every rate), then checked on 2 hosts x 2 ranks, which it was not fitted
on (4 ranks on 2 cores: oversubscription 2); the prediction error per configuration is printed and
kept in the JSON. The projection to 64-512 ranks (one rank per host, each with its own cores:
no oversubscription) takes a_system's latency part (a - c) as growing with log2(ranks) -- an
assumption, stated -- and the wire bytes from the payload model above scaled by the measured
wire/payload ratio.

    python benchmarks/model.py      # writes benchmarks/results/projection.{json,png}
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
TABLES, ROWS, DIM, BATCH = 8, 250_000, 32, 512
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512]
DENSE_PARAMS = (13 + TABLES * DIM) * 256 + 256 + 256 * 64 + 64 + 64 + 1  # the DLRM's MLP
CORES = 2  # of the machine the network benchmark emulates its hosts on
PROJECTED = {"hybridsync-sharded": "ps_sharded", "horovod-allgather-yield": "horovod_allgather"}


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


def payload_bytes(key: str, n: int, rows_by_n: dict) -> float:
    """Model payload per rank per step of `key` at n ranks, the dense all-reduce (ring) included."""
    dense = 2 * (n - 1) / n * DENSE_PARAMS * 4
    return rows_by_n[n][key] + dense


def calibrate(model_rows):
    """Fits the step-time model on the network benchmark's 2 x 1 runs; checks it on 2 x 2."""
    path = RESULTS / "network.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())["summary"]
    by = {(s["rate"], s["per_host"], s["system"]): s for s in summary}
    rate_bytes = {"10gbit": 10e9 / 8, "1gbit": 1e9 / 8}
    systems = sorted({s["system"] for s in summary if ("local", 0, s["system"]) in by and s["per_host"] == 1})
    if not systems:
        return None

    def wire(s):  # bytes this host's link carries each way per step (full duplex: the larger)
        return max(s["wire_tx_per_rank_step"] or 0, s["wire_rx_per_rank_step"] or 0) * s["per_host"]

    compute = {sys_: by[("local", 0, sys_)]["ms_per_step"] / 1e3 for sys_ in systems}
    fit_rows = [s for s in summary if s["per_host"] == 1 and s["system"] in systems and s["rate"] != "local"]
    # t = a_sys + b * wire / rate: one intercept per system, one shared slope (least squares).
    design = np.zeros((len(fit_rows), len(systems) + 1))
    target = np.zeros(len(fit_rows))
    for i, s in enumerate(fit_rows):
        design[i, systems.index(s["system"])] = 1.0
        design[i, -1] = wire(s) / rate_bytes[s["rate"]] if s["rate"] in rate_bytes else 0.0
        target[i] = s["ms_per_step"] / 1e3
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    if solution[-1] < 0:  # a noisy run can tilt the slope below zero: bytes never make a step faster
        solution[:-1], *_ = np.linalg.lstsq(design[:, :-1], target, rcond=None)
        solution[-1] = 0.0
    a = dict(zip(systems, solution[:-1]))
    b = float(solution[-1])

    def predict(system, per_host, rate, wire_bytes):
        oversubscription = max(1.0, 2 * per_host / CORES)
        net = b * wire_bytes / rate_bytes[rate] if rate in rate_bytes else 0.0
        return a[system] + compute[system] * (oversubscription - 1) + net

    checks = []
    for s in summary:
        if s["per_host"] == 2 and s["system"] in systems:
            predicted = predict(s["system"], 2, s["rate"], wire(s))
            checks.append({"system": s["system"], "rate": s["rate"], "ranks": "2x2",
                           "measured_ms": s["ms_per_step"], "predicted_ms": predicted * 1e3,
                           "error": predicted * 1e3 / s["ms_per_step"] - 1})
    # Wire bytes over the payload model's bytes (TCP/IP headers, ids, MPI envelopes) at 2 ranks.
    overhead = {}
    for system, key in PROJECTED.items():
        s = by.get(("1gbit", 1, system))
        if s and system in systems:
            overhead[system] = wire(s) / payload_bytes(key, 2, model_rows)
    projection = []
    for n in RANKS:
        for rate in ("10gbit", "1gbit"):
            row = {"ranks": n, "rate": rate}
            for system, key in PROJECTED.items():
                if system in overhead:
                    latency = max(0.0, a[system] - compute[system]) * max(1.0, np.log2(n))
                    wire_bytes = payload_bytes(key, n, model_rows) * overhead[system]
                    row[system] = (compute[system] + latency + b * wire_bytes / rate_bytes[rate]) * 1e3
            projection.append(row)
    return {"fitted": {"a_ms": {k: v * 1e3 for k, v in a.items()}, "b": b, "link_efficiency": 1 / b if b else None,
                       "compute_ms": {k: v * 1e3 for k, v in compute.items()}, "wire_over_payload": overhead},
            "checks": checks, "projection_ms_per_step": projection}


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
    calibrated = calibrate({r["ranks"]: r for r in rows})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "projection.json").write_text(json.dumps({"model": rows, "measured": points,
                                                         "calibrated": calibrated}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if calibrated else 1, figsize=(14 if calibrated else 7.5, 4.5), squeeze=False)
    ax = axes[0][0]
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
    if calibrated:
        ax2 = axes[0][1]
        proj = calibrated["projection_ms_per_step"]
        for rate, style in (("10gbit", "-"), ("1gbit", "--")):
            for system in PROJECTED:
                pts = [(r["ranks"], r[system]) for r in proj if r["rate"] == rate and system in r]
                if pts:
                    ax2.plot(*zip(*pts), style, marker="o", label=f"{system}, {rate}")
        ax2.set(xscale="log", yscale="log", xlabel="ranks (one per host)", ylabel="ms per step",
                title="Calibrated step time, projected (a model)")
        ax2.set_xticks(RANKS, [str(r) for r in RANKS])
        ax2.grid(alpha=0.3, which="both")
        ax2.legend(fontsize=8)
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
    if calibrated:
        f = calibrated["fitted"]
        efficiency = f"{f['link_efficiency']:.2f}" if f["link_efficiency"] else "unbounded (bytes explained nothing)"
        print(f"\nCALIBRATED step-time model (fitted on 2 hosts x 1 rank): link efficiency {efficiency} "
              "of nominal; a (2 x 1, no limit) / compute (1 rank) ms: "
              + ", ".join(f"{k} {f['a_ms'][k]:.1f}/{f['compute_ms'][k]:.1f}" for k in f["a_ms"]))
        print("checked on 2 hosts x 2 ranks (not fitted on):")
        for c in calibrated["checks"]:
            print(f"  {c['system']:<26} {c['rate']:>9}: measured {c['measured_ms']:6.1f} ms, predicted "
                  f"{c['predicted_ms']:6.1f} ms ({100 * c['error']:+.0f}%)")
        print("projection, one rank per host (ms/step; latency assumed to grow with log2(ranks)):")
        for r in calibrated["projection_ms_per_step"]:
            if r["ranks"] in (2, 64, 128, 256, 512):
                print(f"  {r['ranks']:>4} ranks {r['rate']:>6}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in r.items() if k not in ("ranks", "rate")))
    print(f"wrote {RESULTS / 'projection.json'} and projection.png")


if __name__ == "__main__":
    main()
