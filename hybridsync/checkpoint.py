"""Sharded, atomic, re-shardable checkpoints for both frameworks.

    hybridsync.save_checkpoint(path, model, optimizer, extra=None)   # collective
    extra = hybridsync.load_checkpoint(path, model, optimizer)         # collective, any world size

Layout of a checkpoint (a directory; safetensors files and JSON, nothing pickled):

    manifest.json                 format, world size, plan, every table's layout, server optimizer,
                                  step and files with their SHA-256, the dense files, `extra`
    dense.safetensors             dense weights and the wrapped optimizer's tensors (rank 0)
    table-<i>-shard-<s>.safetensors  shard s of PS table i: its global row ids, rows and server
                                  optimizer slots, written by the rank that owns it (a dynamic
                                  table's also its counts, last touches and ids not yet admitted;
                                  a fixed table with a disk tier's only the rows written, see
                                  below)

A fixed table with a disk tier (storage.path) may be larger than memory: its shard files hold
only the rows that differ from their initial value, streamed in chunks (ps/written_rows.py), and
its manifest entry says so ("rows_saved": "written") with the initializer of the other rows
("initial_rows"); loading resets each shard to that initializer, then writes the saved rows. A
checkpoint with such a table has format hybridsync-checkpoint/2 (a reader of /1 refuses it by
name rather than load its untouched rows wrong); one without stays /1.
A dynamic table's shard files are streamed the same way, both ways (ps/dynamic_shard_file.py):
its rows too may live mostly in a disk tier.

Why safetensors + JSON: a format many tools read, no code runs on load, and each shard file is
written by its owner in parallel with no rank ever holding a whole table (torch's distributed
checkpoint needs torch.distributed, which an MPI job of hybridsync does not start, and TF).

Atomic: every rank writes into a fresh hidden directory next to `path` (`.<name>.<stamp>`); once
all of them report success, rank 0 writes the manifest and publishes the directory by swapping
the symlink `path` onto it (one rename). A crash before that leaves the previous checkpoint in
place, and its half-written directory behind: the next save of that name removes every version
directory of the name but the live one (and its own) before it writes.

Loading re-shards: each PS table is read back under this run's partitioner and world size. When
the layout is unchanged each rank reads only its own shard file; otherwise every rank streams
the saved shard files in bounded chunks (written_rows.CHUNK_ROWS rows at a time) and keeps the rows it owns,
so memory per rank stays its own shard plus one chunk.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from . import array_files, comm, runtime
from . import ps
from .ps import dynamic_shard_file, written_rows
from .ps.dynamic import DynamicTable
from .ps.storage import dtype_of
from .frontend import framework_of
from .frontend import of as frontend_of
from .ps.partition import Partition
from .types import Placement

FORMAT = "hybridsync-checkpoint/1"
FORMAT_WRITTEN_ROWS = "hybridsync-checkpoint/2"  # /1, and tables saved as their written rows
FORMATS = (FORMAT, FORMAT_WRITTEN_ROWS)
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file or variable."""


# -- what a frontend hands over ----------------------------------------------------------------
def _frontend(optimizer):
    found = frontend_of(optimizer)
    if found is not None:
        return found
    if framework_of(optimizer) is not None:
        raise CheckpointError("the optimizer is not a hybridsync DistributedOptimizer (wrap it first)")
    raise TypeError("save_checkpoint / load_checkpoint take a hybridsync DistributedOptimizer (PyTorch or Keras); "
                    f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}")


def _tables(frontend) -> list:
    """(variable, PSTable) of every table the optimizer's plan put on the parameter server."""
    variables = frontend.variables()
    if variables is None:
        raise CheckpointError("the optimizer has no plan yet (a Keras one plans at its first step: save after it)")
    return [(var, var.table) for var in variables if var.table is not None]


# -- collective plumbing -------------------------------------------------------------------------
def _agree(error: str, what: str) -> None:
    """Collective: every rank raises if any rank failed, naming the first that did."""
    errors = comm.objects().allgather_object(error, name=f"hybridsync.checkpoint.{what}")
    for rank, e in enumerate(errors):
        if e:
            raise CheckpointError(e if rank == runtime.world().rank else f"rank {rank}: {e}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_safetensors(arrays: dict, path: Path) -> str:
    array_files.write(arrays, path)  # every dtype kept bit for bit (bfloat16 as raw bits)
    return _sha256(path)


def _shard_file(i: int, shard: int) -> str:
    return f"table-{i}-shard-{shard}.safetensors"


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(path, model, optimizer, extra=None) -> Path:
    """Collective: writes model, optimizer and server state to `path` (see the module doc).
    extra: JSON-serialisable data to keep with it (e.g. {"epoch": 3, "batch": 0})."""
    frontend = _frontend(optimizer)
    world = runtime.world()
    objects = comm.objects()
    final = Path(path).absolute()
    stamp = objects.broadcast_object(uuid.uuid4().hex[:12] if world.rank == 0 else None, 0,
                                     name="hybridsync.checkpoint.stamp")
    version = final.parent / f".{final.name}.{stamp}"
    error, records = "", {}
    try:
        json.dumps(extra)
        if world.rank == 0:
            if final.exists() and not final.is_symlink():
                raise CheckpointError(f"{final} exists and is not a hybridsync checkpoint link; choose another path")
            version.mkdir(parents=True)
            _remove_stale_versions(final, version)
    except Exception as exc:
        error = f"{final}: {exc}"
    _agree(error, "mkdir")
    try:
        tables = _tables(frontend)
        if tables:
            ps.engine().barrier("checkpoint")  # every push started anywhere is in the shards
        for i, (var, table) in enumerate(tables):
            if world.rank < table.layout[0]:
                file = version / _shard_file(i, world.rank)
                if isinstance(table, DynamicTable):  # (streamed: its rows may live mostly on disk)
                    records[file.name] = dynamic_shard_file.save(table, file)
                elif _saves_written_rows(table):
                    records[file.name] = written_rows.save(table, file)
                else:
                    arrays = table.local_state()
                    records[file.name] = {"sha256": _write_safetensors(arrays, file), "rows": int(len(arrays["ids"]))}
        if world.rank == 0:
            arrays, meta = frontend.checkpointing.dense_state(model, optimizer, [var for var, _ in tables])
            records[DENSE] = {"sha256": _write_safetensors(arrays, version / DENSE), "meta": meta}
    except Exception as exc:
        error = f"{exc}"
    everyone = objects.allgather_object((error, records), name="hybridsync.checkpoint.written")
    failed = next((f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e), "")
    if failed:
        if world.rank == 0:
            shutil.rmtree(version, ignore_errors=True)
        raise CheckpointError(f"saving {final} failed on {failed}; the previous checkpoint is unchanged")
    error = ""
    if world.rank == 0:
        try:
            files = {name: rec for _, recs in everyone for name, rec in recs.items()}
            _publish(final, version, _manifest(optimizer, tables, files, extra))
        except Exception as exc:
            error = f"publishing {final}: {exc}"
    _agree(error, "published")
    return final


def _saves_written_rows(table) -> bool:
    """A fixed table with a disk tier: saved as its written rows (it may not fit in memory)."""
    return not isinstance(table, DynamicTable) and table.tiered


def _manifest(optimizer, tables, files: dict, extra) -> dict:
    entries = []
    for i, (var, table) in enumerate(tables):
        shards, partition = table.layout
        sparse = {"rows_saved": "written", "initial_rows": table.row_init()} if _saves_written_rows(table) else {}
        entries.append({
            "variable": var.name, "num_rows": table.num_rows, "dim": table.dim, "shards": shards,
            "partition": partition, "optimizer": table.optimizer, "slots": table.slot_names, "step": table.step,
            # rows are saved as float32, which holds 16-bit rows exactly; their dtype, for the record
            "row_dtype": dtype_of(table.storage),
            "files": [{"name": _shard_file(i, s), **files[_shard_file(i, s)]} for s in range(shards)],
            **sparse,
        })
    dense = files[DENSE]
    plan = getattr(optimizer, "plan", None)
    written = any(entry.get("rows_saved") == "written" for entry in entries)
    return {"format": FORMAT_WRITTEN_ROWS if written else FORMAT, "world_size": runtime.world().size, "plan": plan.to_json() if plan else None,
            "tables": entries, "dense": {"name": DENSE, "sha256": dense["sha256"], "meta": dense["meta"]},
            "extra": extra}


def _publish(final: Path, version: Path, manifest: dict) -> None:
    tmp = version / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, version / MANIFEST)
    _fsync_dir(version)
    previous = final.resolve() if final.is_symlink() else None
    link = final.parent / f".{final.name}.link-{version.name}"
    os.symlink(version.name, link)
    os.replace(link, final)  # the one rename that publishes the checkpoint
    _fsync_dir(final.parent)
    if previous is not None and previous != version and previous.parent == final.parent:
        shutil.rmtree(previous, ignore_errors=True)


def _stamp_pattern(final: Path) -> re.Pattern:
    """The hidden names save_checkpoint makes for `final`: version directories `.<name>.<stamp>`
    and the link `.<name>.link-.<name>.<stamp>` it renames onto `final` (12 hex digits each)."""
    name = re.escape(final.name)
    return re.compile(rf"\.{name}\.(?:link-\.{name}\.)?[0-9a-f]{{12}}")


def _remove_stale_versions(final: Path, writing: Path) -> None:
    """Rank 0, as a save of `final` starts: removes what crashed saves of it left (version
    directories and links), before a new full copy needs the space; never the live version (the
    one `final` points to) nor `writing`. Best effort: what cannot be removed now is tried again
    at the next save. (No other save of this path runs meanwhile: saves are collective.)"""
    pattern = _stamp_pattern(final)
    keep = {writing.resolve(), final.resolve() if final.is_symlink() else None}
    for entry in final.parent.iterdir():
        if not pattern.fullmatch(entry.name):
            continue
        try:
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink()  # (a link: never what it points to)
            elif entry.resolve() not in keep:
                shutil.rmtree(entry)
        except OSError:
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- load -----------------------------------------------------------------------------------------
def load_checkpoint(path, model, optimizer):
    """Collective: restores model, optimizer and server state from `path`, at any world size
    (rows re-sharded by this run's partitioner). Returns the checkpoint's `extra`."""
    frontend = _frontend(optimizer)
    error, manifest, tables = "", None, []
    try:
        manifest = _read_manifest(Path(path))
    except Exception as exc:
        error = str(exc)
    _agree(error, "manifest")
    try:
        frontend.checkpointing.before_load(model, optimizer, manifest)  # Keras before its first step: its plan, now
    except Exception as exc:
        error = f"{exc}"
    _agree(error, "planned")
    _adopt_auto(frontend, manifest)
    try:
        tables = _tables(frontend)
        _check_same_model(manifest, tables)
        for (var, table), saved in zip(tables, manifest["tables"]):
            _load_table(Path(path), var, table, saved)
        dense = Path(path) / DENSE
        _verify(dense, manifest["dense"]["sha256"])
        frontend.checkpointing.load_dense_state(model, optimizer, [var for var, _ in tables], array_files.read(dense),
                                  manifest["dense"]["meta"])
    except Exception as exc:
        error = str(exc)
    _agree(error, "loaded")
    for var, table in tables:  # replicas (replicated placement) take the loaded rows whole
        _refresh_replica(var, table)
    return manifest["extra"]


def _refresh_replica(var, table) -> None:
    """Replicated placement: the variable (every rank's whole copy) takes the loaded rows, and
    so does the shard where it keeps a copy of its own instead of aliasing the variable."""
    if var.plan.placement is not Placement.REPLICATED:
        return
    var.access.set_replica(table.read())
    if table.attached is None:
        table.scatter(var.access.replica_copy())


def check_dense_match(model: dict, saved: dict, shown=lambda key: key) -> None:
    """The frontends' dense state against a checkpoint's, both {key: shape}: the same keys and
    shapes, else a ValueError naming the first variable (shown(key)) that differs."""
    for key in sorted(set(model) ^ set(saved)):
        where = "the model" if key in model else "the checkpoint"
        raise ValueError(f"variable '{shown(key)}' is only in {where} (a checkpoint of another model?)")
    for key, shape in model.items():
        if tuple(saved[key]) != tuple(shape):
            raise ValueError(f"variable '{shown(key)}': checkpoint has shape {tuple(saved[key])}, the model {tuple(shape)}")


def _adopt_auto(frontend, manifest: dict) -> None:
    """Collective: where this run's `sync: auto` is still measuring, it takes the saved run's
    decisions, so tables that run moved off the parameter server (or re-sharded) are laid out as
    they were saved, without the saved JSON plan as config."""
    plan = manifest.get("plan") or {}
    saved = {v["name"]: v["auto"] for v in plan.get("variables", []) if v.get("auto")}
    if saved:
        frontend.adopt_auto(saved)


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not file.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint: {file} is missing")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{file} is corrupt: {exc}") from None
    if manifest.get("format") not in FORMATS:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r}, expected one of {', '.join(map(repr, FORMATS))} "
                              "(a checkpoint of a newer hybridsync?)")
    return manifest


def _check_same_model(manifest: dict, tables: list) -> None:
    saved = manifest["tables"]
    for k, (var, table) in enumerate(tables):
        if k >= len(saved):
            raise CheckpointError(f"variable '{var.name}' is on the parameter server here but not in the checkpoint "
                                  "(a checkpoint of another model?)")
        entry = saved[k]
        if entry["variable"] != var.name or (entry["num_rows"], entry["dim"]) != (table.num_rows, table.dim):
            raise CheckpointError(
                f"variable '{var.name}' {table.num_rows}x{table.dim} does not match the checkpoint's table #{k} "
                f"'{entry['variable']}' {entry['num_rows']}x{entry['dim']} (a checkpoint of another model?)")
        if entry["optimizer"] != table.optimizer:
            raise CheckpointError(f"variable '{var.name}': checkpoint has server optimizer '{entry['optimizer']}', "
                                  f"this run uses '{table.optimizer}'")
    if len(saved) > len(tables):
        raise CheckpointError(f"the checkpoint's table '{saved[len(tables)]['variable']}' is not on the parameter "
                              "server in this model (a checkpoint of another model?)")


def _verify(file: Path, sha256: str) -> None:
    if not file.exists():
        raise CheckpointError(f"incomplete checkpoint: {file} is missing")
    if _sha256(file) != sha256:
        raise CheckpointError(f"{file} is corrupt (its SHA-256 does not match the manifest)")


def _load_table(path: Path, var, table, saved: dict) -> None:
    """Writes the saved rows (and slots) this rank owns under this run's layout."""
    rank = runtime.world().rank
    shards, kind = table.layout
    if rank >= shards:
        table.set_step(saved["step"])
        return
    if isinstance(table, DynamicTable):
        _load_dynamic_table(path, table, saved)
        return
    mine = Partition(table.num_rows, shards, kind)
    same_layout = (saved["shards"], saved["partition"]) == (shards, kind)
    files = [saved["files"][rank]] if same_layout else saved["files"]
    for entry in files:
        _verify(path / entry["name"], entry["sha256"])
    if saved.get("rows_saved") == "written":  # the rows not in the files: their initial values
        table.reset_rows(saved["initial_rows"])
    for entry in files:
        file = path / entry["name"]
        try:
            written_rows.write_back(table, file, entry["rows"], saved["slots"], keep=lambda ids: mine.shard_of(ids) == rank)
        except Exception as exc:
            raise CheckpointError(f"{file}: {exc}") from exc
    table.set_step(saved["step"])


def _load_dynamic_table(path: Path, table, saved: dict) -> None:
    """Every saved shard file in chunks (dynamic_shard_file); this rank's shard keeps the ids it owns under
    this run's hash partition (any world size). The shard is emptied first: what training stored
    before the load (a Keras model steps once to build its plan) is not in the checkpoint. The
    step first: expiry counts from it."""
    table.clear()
    table.set_step(saved["step"])
    for entry in saved["files"]:
        file = path / entry["name"]
        _verify(file, entry["sha256"])
        try:
            dynamic_shard_file.write_back(table, file, saved["slots"])
        except Exception as exc:
            raise CheckpointError(f"{file}: {exc}") from exc
