"""Keras side-by-side: the flagship DLRM in Keras 3 under TensorFlow's own strategies and hybridsync.

The workload is benchmarks/run_one.py's (8 tables x 250,000 x 32, 13 dense features, MLP
269-256-64-1, batch 512 per process, SGD, ids ~ Zipf(1.2) mod rows, the teacher's labels, the
same global batches: generated once by examples/torch_dlrm.py's SyntheticCriteo and sliced per
process), written as a Keras user writes it: a keras.Model, a custom loop whose step is a
tf.function (GradientTape, the optimizer's apply_gradients), one thread per process
(tf.config.threading: intra- and inter-op pools of 1). Systems:

  tf-mwms              tf.distribute.MultiWorkerMirroredStrategy, RING collectives, TF_CONFIG
                       workers on localhost ports: 1 and 2 processes
  tf-ps                tf.distribute.ParameterServerStrategy: 1 ps + 2 workers + the chief that
                       coordinates (ClusterCoordinator), every task its own process; the workers
                       step asynchronously, so ms/step is the time of one step of every worker;
                       its servers need 2 inter-op threads (with 1 they deadlock), ops 1 thread
  hybridsync-keras     keras.layers.Embedding tables (what a Horovod script has), the model as it
                       is, hybridsync.tensorflow.DistributedOptimizer(..., model=model), which moves
                       those tables onto the PS shards (the loop is a custom one: model= is how
                       its optimizer sees the model before the step is traced): 1 and 2 ranks
  hybridsync-sharded   hybridsync.tensorflow.Embedding tables (rows only on the PS shards): 1, 2

Per configuration: ms/step (elapsed / timed steps), samples/s, and the peak RSS of every process
(ru_maxrss; a ParameterServerStrategy server's VmHWM, read before it is stopped); medians over
interleaved rounds, the load average beside each round.

    python benchmarks/keras_side_by_side.py            # full size: 3 rounds, 200 timed steps (about 30 minutes)
    python benchmarks/keras_side_by_side.py --quick    # a smoke run: 1 round, 20 steps, 20,000-row tables

(Named keras_side_by_side.py, not keras.py: run as a script, its directory comes first on sys.path
and a keras.py there would be imported as the keras package.)

Writes benchmarks/results/keras.{json,md,png} (--quick: keras-quick.*) and updates docs/performance.md
between <!-- bench-keras:start --> and <!-- bench-keras:end -->.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["tf-mwms", "tf-ps", "hybridsync-keras", "hybridsync-sharded"]
NAMES = {"tf-mwms": "TensorFlow MultiWorkerMirroredStrategy (RING)",
         "tf-ps": "TensorFlow ParameterServerStrategy (1 ps, 2 workers, chief)",
         "hybridsync-keras": "hybridsync, `keras.layers.Embedding` (what a Horovod script has; moved to the shards by `model=`)",
         "hybridsync-sharded": "hybridsync, `hybridsync.tensorflow.Embedding` (sharded PS)"}
PS_WORKERS = 2  # ParameterServerStrategy runs at this many workers only
# A ParameterServerStrategy server (ps, worker) with one inter-op thread never finishes a step: the
# chief's first closures wait forever (seen with TF 2.21). Two is the fewest that run; each op
# still runs on one thread (intra-op 1).
PS_SERVER_INTER_OP = 2
DENSE = 13
RESULT = "KERAS-RESULT "


# -- the workload, in every process ----------------------------------------------------------------

def one_thread() -> None:
    """One thread per process, as every system in benchmarks/ has: before TensorFlow starts."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def build_model(args, embedding):
    """The DLRM as a Keras model: `embedding(rows, dim, name)` makes each table."""
    import keras
    import tensorflow as tf

    class DLRM(keras.Model):
        def __init__(self):
            super().__init__()
            self.tables = [embedding(args.rows, args.dim, f"table_{k}") for k in range(args.tables)]
            self.mlp = [keras.layers.Dense(256, activation="relu"), keras.layers.Dense(64, activation="relu"),
                        keras.layers.Dense(1)]

        def call(self, inputs):
            dense, ids = inputs
            x = tf.concat([dense] + [t(ids[:, k]) for k, t in enumerate(self.tables)], axis=1)
            for layer in self.mlp:
                x = layer(x)
            return tf.squeeze(x, 1)

    return DLRM()


def keras_embedding(rows, dim, name):
    """A plain Keras table, initialised as the DLRM's: uniform(+-1/sqrt(rows))."""
    import keras

    bound = 1.0 / np.sqrt(rows)
    return keras.layers.Embedding(rows, dim, embeddings_initializer=keras.initializers.RandomUniform(-bound, bound),
                                  name=name)


def ps_embedding(rows, dim, name):
    import hybridsync.tensorflow as hvd

    bound = 1.0 / np.sqrt(rows)
    return hvd.Embedding(rows, dim, initializer=("uniform", -bound, bound), name=name)


def my_batches(args, part: int, parts: int):
    """This process's slice (part of parts) of every global batch: (dense, ids, label) arrays."""
    data = Path(args.data)
    out = []
    arrays = [np.load(data / f"{name}.npy", mmap_mode="r") for name in ("dense", "ids", "label")]
    width = arrays[0].shape[1] // parts
    for step in range(arrays[0].shape[0]):
        out.append(tuple(np.ascontiguousarray(a[step, part * width:(part + 1) * width]) for a in arrays))
    return out


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)


def bce(label, logits):
    import tensorflow as tf

    return tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits)


# -- hybridsync (under mpirun) ---------------------------------------------------------------------

def worker_hybridsync(args) -> None:
    one_thread()
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    import hybridsync.tensorflow as hvd

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    batches = my_batches(args, rank, size)
    keras.utils.set_random_seed(args.seed)
    model = build_model(args, ps_embedding if args.worker == "hybridsync-sharded" else keras_embedding)
    model((tf.constant(batches[0][0]), tf.constant(batches[0][1])))  # builds the variables
    # model=: the plain Keras tables move onto the PS shards (from rank 0's rows) before the step is traced.
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr), model=model)
    hvd.broadcast_variables(model.variables, 0)

    @tf.function(jit_compile=False)  # hybridsync's exchange is a Python op, which XLA cannot compile
    def step(dense, ids, label):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(bce(label, model((dense, ids))))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    elapsed, losses = timed_loop(args, batches, step, comm.Barrier)
    mine = {"rss": peak_rss(), "loss": float(np.mean(losses[-20:]))}
    everyone = comm.gather(mine, root=0)
    if rank == 0:
        report({"processes": size, "elapsed_s": elapsed, "rss": [e["rss"] for e in everyone],
                "roles": ["rank"] * size, "loss": float(np.mean([e["loss"] for e in everyone]))})


def timed_loop(args, batches, step, barrier):
    """Warmup steps, a barrier, the timed steps (each waits for its loss, as a training loop that
    logs it does), a barrier: (seconds, losses)."""
    import tensorflow as tf

    tensors = [tuple(tf.constant(a) for a in b) for b in batches]
    losses = []
    for b in tensors[:args.warmup]:
        losses.append(float(step(*b)))
    barrier()
    start = time.perf_counter()
    for b in tensors[args.warmup:args.warmup + args.steps]:
        losses.append(float(step(*b)))
    barrier()
    return time.perf_counter() - start, losses


# -- MultiWorkerMirroredStrategy (one process per worker, TF_CONFIG) -------------------------------

def worker_mwms(args) -> None:
    one_thread()
    import keras
    import tensorflow as tf

    config = json.loads(os.environ["TF_CONFIG"])
    workers, index = len(config["cluster"]["worker"]), config["task"]["index"]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    batches = my_batches(args, index, workers)
    global_batch = batches[0][0].shape[0] * workers
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = build_model(args, keras_embedding)
        model((tf.constant(batches[0][0]), tf.constant(batches[0][1])))
        opt = keras.optimizers.SGD(args.lr)
        opt.build(model.trainable_variables)

    @tf.function
    def step(dense, ids, label):
        def replica_step(dense, ids, label):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(bce(label, model((dense, ids))), global_batch_size=global_batch)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=(dense, ids, label))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    @tf.function
    def barrier():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

    elapsed, losses = timed_loop(args, batches, step, barrier)
    report({"task": index, "processes": workers, "elapsed_s": elapsed, "rss": [peak_rss()], "roles": ["worker"],
            "loss": float(np.mean(losses[-20:]))})


# -- ParameterServerStrategy: servers (ps, worker) and the chief that coordinates ------------------

def server_ps(args) -> None:
    """A ps or worker task: a TensorFlow server with one-thread pools, until it is stopped."""
    import tensorflow as tf

    config = json.loads(os.environ["TF_CONFIG"])
    session = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=PS_SERVER_INTER_OP)
    server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=config["task"]["type"],
                                  task_index=config["task"]["index"], protocol="grpc", config=session, start=True)
    print(f"server {config['task']['type']}:{config['task']['index']} up", flush=True)
    server.join()


def chief_ps(args) -> None:
    one_thread()
    import keras
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    workers = resolver.cluster_spec().num_tasks("worker")
    batches = my_batches(args, 0, 1)  # whole global batches of `workers` x batch: each call takes a worker's slice
    per_worker = batches[0][0].shape[0] // workers
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = build_model(args, keras_embedding)
        model((tf.constant(batches[0][0][:per_worker]), tf.constant(batches[0][1][:per_worker])))
        opt = keras.optimizers.SGD(args.lr)
        opt.build(model.trainable_variables)

    @tf.function
    def step(dense, ids, label):
        def replica_step(dense, ids, label):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(bce(label, model((dense, ids))))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        return strategy.run(replica_step, args=(dense, ids, label))

    calls = []  # the k-th call of a round of `workers` calls gets worker slice k of a global batch
    for dense, ids, label in batches:
        for k in range(workers):
            part = slice(k * per_worker, (k + 1) * per_worker)
            calls.append((tf.constant(dense[part]), tf.constant(ids[part]), tf.constant(label[part])))
    warm, timed = calls[:args.warmup * workers], calls[args.warmup * workers:(args.warmup + args.steps) * workers]
    for c in warm:
        coordinator.schedule(step, args=c)
    coordinator.join()
    start = time.perf_counter()
    results = [coordinator.schedule(step, args=c) for c in timed]
    coordinator.join()
    elapsed = time.perf_counter() - start
    losses = [float(r.fetch()) for r in results[-20 * workers:]]
    report({"processes": workers, "elapsed_s": elapsed, "rss": [peak_rss()], "roles": ["chief"],
            "loss": float(np.mean(losses))})


# -- the driver ------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(args, processes: int, directory: Path) -> None:
    """Global batches of `processes` x batch for warmup + steps, as run_one.py makes them."""
    sys.path.insert(0, str(ROOT / "examples"))
    from torch_dlrm import SyntheticCriteo

    data = SyntheticCriteo(args.batch * processes, args.tables, args.rows, seed=args.seed)
    dense, ids, label = zip(*(data.batch() for _ in range(args.warmup + args.steps)))
    directory.mkdir(parents=True, exist_ok=True)
    for name, arrays in (("dense", dense), ("ids", ids), ("label", label)):
        np.save(directory / f"{name}.npy", np.stack([a.numpy() for a in arrays]))


def worker_args(args, data: Path) -> list[str]:
    return ["--data", str(data), "--steps", str(args.steps), "--warmup", str(args.warmup), "--rows", str(args.rows),
            "--tables", str(args.tables), "--dim", str(args.dim), "--lr", str(args.lr), "--seed", str(args.seed)]


def env_for(tf_config: dict | None = None) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def parse(output: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(rf"^{RESULT}(\{{.*\}})$", output, re.M)]


def vm_hwm(pid: int) -> int | None:
    """A live process's peak RSS (VmHWM), bytes."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 if found else None


def run_hybridsync(system, processes, args, data, timeout):
    cmd = ["mpirun", "-np", str(processes), "--oversubscribe", "--bind-to", "none"]
    cmd += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd += [sys.executable, __file__, "--worker", system, *worker_args(args, data)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_for(), cwd=ROOT)
    found = parse(out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError((out.stdout + out.stderr)[-3000:])
    return found[0]


def run_mwms(processes, args, data, timeout):
    ports = [free_port() for _ in range(processes)]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "tf-mwms", *worker_args(args, data)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env=env_for({"cluster": cluster, "task": {"type": "worker", "index": i}}))
             for i in range(processes)]
    outputs = communicate(procs, timeout)
    found = [r for out in outputs for r in parse(out)]
    if any(p.returncode for p in procs) or len(found) != processes:
        raise RuntimeError("\n".join(o[-1500:] for o in outputs))
    found.sort(key=lambda r: r["task"])
    return {"processes": processes, "elapsed_s": max(r["elapsed_s"] for r in found),
            "rss": [r["rss"][0] for r in found], "roles": ["worker"] * processes,
            "loss": float(np.mean([r["loss"] for r in found]))}


def run_ps(args, data, timeout):
    ports = {role: [free_port() for _ in range(n)] for role, n in (("chief", 1), ("worker", PS_WORKERS), ("ps", 1))}
    cluster = {role: [f"localhost:{p}" for p in ps] for role, ps in ports.items()}
    servers = []
    for role in ("ps", "worker"):
        for i in range(len(cluster[role])):
            servers.append((role, subprocess.Popen(
                [sys.executable, __file__, "--worker", "tf-ps-server", *worker_args(args, data)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                env=env_for({"cluster": cluster, "task": {"type": role, "index": i}}))))
    chief = subprocess.Popen([sys.executable, __file__, "--worker", "tf-ps-chief", *worker_args(args, data)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                             env=env_for({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    try:
        out = communicate([chief], timeout)[0]
        server_rss = [(role, vm_hwm(p.pid)) for role, p in servers]  # before they are stopped
    finally:
        for _, p in servers:
            p.kill()
        server_out = [p.communicate()[0] or "" for _, p in servers]
    found = parse(out)
    if chief.returncode != 0 or not found or any(rss is None for _, rss in server_rss):
        raise RuntimeError(out[-3000:] + "\n" + "\n".join(o[-800:] for o in server_out))
    r = found[0]
    return {"processes": PS_WORKERS, "elapsed_s": r["elapsed_s"], "rss": r["rss"] + [rss for _, rss in server_rss],
            "roles": ["chief"] + [role for role, _ in server_rss], "loss": r["loss"]}


def communicate(procs, timeout) -> list[str]:
    """Every process's output; all are killed if any outlives `timeout`."""
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        said = "\n".join((p.communicate()[0] or "")[-1500:] for p in procs)
        raise RuntimeError(f"timed out after {timeout} s; the processes said:\n{said}")
    return outputs


def plan(args) -> list[tuple[str, int, int]]:
    """(system, processes, round) of every run: rounds of every configuration, each round starting
    with another system."""
    configs = []
    for system in args.systems:
        counts = [PS_WORKERS] if system == "tf-ps" else args.processes
        configs += [(system, n) for n in counts]
    runs = []
    for round_ in range(args.repeats):
        k = round_ % len(configs)
        runs += [(s, n, round_) for s, n in configs[k:] + configs[:k]]
    return runs


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summarise(raw: list[dict], args) -> list[dict]:
    groups = {}
    for r in raw:
        if "error" not in r:
            groups.setdefault((r["system"], r["processes"]), []).append(r)
    out = []
    for (system, processes), rs in sorted(groups.items(), key=lambda kv: (SYSTEMS.index(kv[0][0]), kv[0][1])):
        ms = float(np.median([r["elapsed_s"] / args.steps * 1e3 for r in rs]))
        rss_by_role = {}
        for r in rs:
            for role, rss in zip(r["roles"], r["rss"]):
                rss_by_role.setdefault(role, []).append(rss)
        out.append({"system": system, "processes": processes, "repeats": len(rs), "ms_per_step": ms,
                    "samples_per_s": args.batch * processes * 1e3 / ms,
                    "peak_rss_max": float(np.median([max(r["rss"]) for r in rs])),
                    "peak_rss_min": float(np.median([min(r["rss"]) for r in rs])),
                    "peak_rss_by_role": {role: float(np.median(v)) for role, v in rss_by_role.items()},
                    "loss": float(np.median([r["loss"] for r in rs]))})
    return out


def markdown(summary, raw, meta) -> str:
    by = {(s["system"], s["processes"]): s for s in summary}
    counts = sorted({s["processes"] for s in summary})
    top = max(counts) if counts else 2

    def rss(s):
        lo, hi = s["peak_rss_min"] / 2**20, s["peak_rss_max"] / 2**20
        return f"{hi:.0f} MB" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} MB"

    lines = [f"Measured {meta['date']} on {meta['cores']} cores; Keras {meta['keras']}, TensorFlow {meta['tf']}; "
             f"DLRM {meta['tables']} tables x {meta['rows']:,} x {meta['dim']}, batch {meta['batch']} per process, SGD; "
             f"medians of {meta['repeats']} interleaved rounds of {meta['steps']} timed steps (after {meta['warmup']}); "
             "1 thread per process. ParameterServerStrategy: its workers step asynchronously; ms/step is the "
             "time in which every worker takes one step; RSS over its chief, ps and workers."
             + (" SMOKE RUN: not the workload's sizes." if meta.get("smoke") else ""), "",
             "| system | " + " | ".join(f"{n} process{'es' if n > 1 else ''}" for n in counts)
             + f" | peak RSS/process at {top} |",
             "| --- | " + " | ".join("---:" for _ in counts) + " | ---: |"]
    for system in SYSTEMS:
        cells = []
        for n in counts:
            s = by.get((system, n))
            cells.append(f"{s['ms_per_step']:.2f} ms" if s else "--")
        at_top = by.get((system, top))
        if any(c != "--" for c in cells):
            lines.append(f"| {NAMES[system]} | " + " | ".join(cells) + f" | {rss(at_top) if at_top else '--'} |")
    rounds = {}
    for r in raw:
        rounds.setdefault(r["round"], r["loadavg"])
    lines.append("\nLoad average (1 / 5 / 15 min) at the start of each round: "
                 + "; ".join(f"round {k + 1}: {' / '.join(f'{x:.2f}' for x in v)}" for k, v in sorted(rounds.items()))
                 + ".")
    failed = [f"{r['system']} x{r['processes']}" for r in raw if "error" in r]
    lines.append(f"\nFailed runs: {', '.join(failed)}." if failed else "\nNo run failed.")
    sharded, plain = by.get(("hybridsync-sharded", 1)), by.get(("hybridsync-keras", 1))
    for n in counts:
        sharded, plain = by.get(("hybridsync-sharded", n)), by.get(("hybridsync-keras", n))
        if sharded and plain:
            lines.append(f"\n- {n} process(es): `keras.layers.Embedding` under hybridsync takes "
                         f"{plain['ms_per_step'] / sharded['ms_per_step']:.2f}x the step time of "
                         f"`hybridsync.tensorflow.Embedding` (issue 39's goal: <= 1.2x).")
    return "\n".join(lines)


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system in SYSTEMS:
        rows = [s for s in summary if s["system"] == system]
        if not rows:
            continue
        ax1.plot([s["processes"] for s in rows], [s["ms_per_step"] for s in rows], marker="o", label=system)
        ax2.plot([s["processes"] for s in rows], [s["peak_rss_max"] / 2**20 for s in rows], marker="o", label=system)
    ax1.set(title="Step time (lower is better)", xlabel="processes (training)", ylabel="ms/step", yscale="log")
    ax2.set(title="Peak RSS, largest process (lower is better)", xlabel="processes (training)", ylabel="MB")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({s["processes"] for s in summary}))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def driver(args) -> None:
    from tqdm import tqdm

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench import RESULTS, results_image, update_docs

    for tool in (["mpirun"] if any(s.startswith("hybridsync") for s in args.systems) else []):
        if not shutil.which(tool):
            sys.exit(f"keras_side_by_side.py: `{tool}` is not on PATH (the hybridsync systems run under it)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras  # their versions, for the table
    import tensorflow as tf

    runs = plan(args)
    raw = []
    with tempfile.TemporaryDirectory(prefix="hybridsync-keras-bench-") as tmp:
        datasets = {}
        for n in sorted({n for _, n, _ in runs}):
            datasets[n] = Path(tmp) / f"data-{n}"
            make_data(args, n, datasets[n])
        current = -1
        for system, n, round_ in tqdm(runs, desc="keras runs", unit="run"):
            if round_ != current:
                current = round_
                tqdm.write(f"round {round_ + 1}/{args.repeats}: load average {' / '.join(map(str, load_average()))}")
            entry = {"system": system, "processes": n, "round": round_, "loadavg": load_average()}
            try:
                if system == "tf-mwms":
                    result = run_mwms(n, args, datasets[n], args.timeout)
                elif system == "tf-ps":
                    result = run_ps(args, datasets[n], args.timeout)
                else:
                    result = run_hybridsync(system, n, args, datasets[n], args.timeout)
                entry.update(result)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                entry["error"] = str(e)[-3000:]
                tqdm.write(f"FAILED {system} x{n}: {entry['error'][-1500:]}")
            raw.append(entry)
    summary = summarise(raw, args)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(),
            "keras": keras.__version__, "tf": tf.__version__, "tables": args.tables, "rows": args.rows,
            "dim": args.dim, "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "smoke": args.quick or args.rows != 250_000}
    table = markdown(summary, raw, meta)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": raw}, indent=2))
    (RESULTS / f"{args.name}.md").write_text(table + "\n")
    plot(summary, RESULTS / f"{args.name}.png")
    print(table)
    print(f"\nwrote {RESULTS / args.name}.json, .md, .png")
    if not args.no_docs and not meta["smoke"] and args.name == "keras":
        update_docs("bench-keras", table + "\n\n" + results_image("Keras side by side", "keras.png"))
    if any("error" in r for r in raw):
        sys.exit("keras_side_by_side.py: some runs failed (listed above and in the JSON)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--processes", default="1,2", help="process counts of tf-mwms and the hybridsync systems")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=512, help="per process")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="run_one.py's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="1 round, 20 steps, 20,000-row tables: a smoke run")
    p.add_argument("--name", default=None, help="results/<name>.{json,md,png} (default keras; --quick: keras-quick)")
    p.add_argument("--no-docs", action="store_true", help="leave docs/performance.md as it is")
    p.add_argument("--worker", choices=SYSTEMS + ["tf-ps-server", "tf-ps-chief"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        {"hybridsync-keras": worker_hybridsync, "hybridsync-sharded": worker_hybridsync, "tf-mwms": worker_mwms,
         "tf-ps-server": server_ps, "tf-ps-chief": chief_ps}[args.worker](args)
        return
    args.systems = args.systems.split(",")
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"keras_side_by_side.py: unknown system(s) {unknown}; known: {SYSTEMS}")
    args.processes = [int(x) for x in args.processes.split(",")]
    if args.quick:
        args.repeats, args.steps, args.warmup, args.rows = 1, 20, 5, min(args.rows, 20_000)
    args.name = args.name or ("keras-quick" if args.quick else "keras")
    driver(args)


if __name__ == "__main__":
    main()
