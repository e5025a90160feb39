"""Per-variable overrides in one YAML file (schema: ../shared/DESIGN.md section 3).

    defaults:
      dense:  {sync: allreduce, compression: none}      # allreduce | ps
      sparse: {sync: auto, placement: sharded}          # auto | ps | allgather | allreduce (as dense)
    variables:                                          # first match wins; glob on the name
      - match: "emb.*"
        sync: ps
        partitions: 4
        optimizer: {name: adagrad, lr: 0.05, initial_accumulator_value: 0.1}
      - match: "mlp.0.*"
        compression: fp16
      - match: "word_emb.*"
        staleness: 4                                    # bounded staleness (sync: ps, sharded); 0: synchronous
      - match: "user_ids.*"                             # a hybridsync DynamicEmbedding's options
        dynamic: {capacity: 1000000, evict: lru, ttl_steps: 5000, admit_after: 2}
      - match: "item_emb.*"                             # how a PS table's shards store its rows
        storage: {dtype: float16}                       # (docs/storage.md; also under defaults.sparse)
    strict: true                                        # a rule that matches nothing is an error (else a warning)
    backend: mpi                                        # dense backend: horovod | mpi (optional)
    auto_steps: 20                                      # steps `sync: auto` measures before it decides
    auto_trial_steps: 8                                 # steps each route worth trying runs, timed (0: the
                                                        # cost model decides alone)
    memory_per_rank: 8GiB                               # what tables may take per rank (bytes or "512MiB",
                                                        # "8GiB"; default: the host's available memory / its ranks x 0.8)

Loaded with yaml.safe_load semantics; every error is a ConfigError naming file, line and key.
A plan written by `python -m hybridsync explain --json` loads back as a config.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os

import yaml

from .settings import settings


class ConfigError(ValueError):
    """A config file (or dict) hybridsync cannot use; the message names file:line and key."""


class ConfigWarning(UserWarning):
    """A config hybridsync can use, with something that looks like a mistake (a rule that
    matches no variable, without strict: true); the message names file:line and key."""


SYNC_DENSE = ("allreduce", "ps")
SYNC_SPARSE = ("auto", "ps", "allgather", "allreduce", "allreduce-as-dense")
PLACEMENTS = ("sharded", "replicated")
PARTITIONS = ("cyclic", "block")
COMPRESSIONS = ("none", "fp16")
OPTIMIZERS = ("sgd", "adagrad", "adam")
BACKENDS = ("horovod", "mpi")
RULE_KEYS = ("match", "sync", "placement", "partitions", "partition", "compression", "optimizer", "staleness",
             "dynamic", "storage")
DEFAULT_KEYS = ("sync", "placement", "partitions", "partition", "compression", "optimizer", "staleness", "storage")
DYNAMIC_KEYS = ("capacity", "evict", "ttl_steps", "admit_after")


@dataclasses.dataclass
class Settings:
    """Route settings of a rule or a default; None means 'not set here'."""

    sync: str | None = None
    placement: str | None = None
    partitions: int | None = None
    partition: str | None = None
    compression: str | None = None
    optimizer: dict | None = None
    staleness: int | None = None  # bounded staleness of a PS table (docs/staleness.md)
    dynamic: dict | None = None  # a DynamicEmbedding's options (rules only)
    storage: dict | None = None  # how a PS table stores its rows (rules, defaults.sparse; hybridsync.ps.storage)


@dataclasses.dataclass
class Rule(Settings):
    match: str = "*"
    where: str = ""  # "file:line", for errors and for the plan's 'why'


@dataclasses.dataclass
class Config:
    dense: Settings
    sparse: Settings
    rules: list
    strict: bool = False
    backend: str | None = None
    auto_steps: int | None = None  # steps `sync: auto` measures (None: HYBRIDSYNC_AUTO_STEPS)
    auto_trial_steps: int | None = None  # steps each tried assignment runs (None: measure.TRIAL_STEPS; 0: none)
    memory_per_rank: int | None = None  # bytes the tables may take per rank (None: from the host's memory)
    source: str = "<dict>"
    where: dict = dataclasses.field(default_factory=dict)  # "defaults.dense" etc. -> "file:line"

    def rule_for(self, name: str):
        """The first rule whose glob matches `name`, or None."""
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.match):
                return rule
        return None

    def storage_for(self, name: str) -> tuple[dict | None, str]:
        """(storage, where it was set) of the sparse table `name`: its rule's `storage:`, else
        defaults.sparse's (where: "defaults.sparse (file:line)"); (None, "") when the config
        sets none (the table keeps its own)."""
        rule = self.rule_for(name)
        if rule is not None and rule.storage is not None:
            return rule.storage, rule.where
        if self.sparse.storage is not None:
            return self.sparse.storage, f"defaults.sparse ({self.where.get('defaults.sparse', self.source)})"
        return None, ""


# -- reading YAML while keeping line numbers -------------------------------------------------------

class _Node:
    """A composed YAML value with where it came from."""

    def __init__(self, value, line):
        self.value, self.line = value, line


def _compose(text: str, source: str):
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return _convert(node) if node is not None else _Node({}, 1)


def _convert(node) -> _Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            out[yaml.safe_load(yaml.serialize(key_node))] = (_convert(value_node), key_node.start_mark.line + 1)
        return _Node(out, line)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(item) for item in node.value], line)
    return _Node(yaml.safe_load(yaml.serialize(node)), line)


def _plain(value):
    """A composed value back to plain Python."""
    if isinstance(value, _Node):
        value = value.value
    if isinstance(value, dict):
        return {k: _plain(v[0]) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _from_dict(d, line=0):
    """A plain dict (from code) as composed nodes without line numbers."""
    if isinstance(d, dict):
        return _Node({k: (_from_dict(v, line), line) for k, v in d.items()}, line)
    if isinstance(d, list):
        return _Node([_from_dict(v, line) for v in d], line)
    return _Node(d, line)


# -- validation -------------------------------------------------------------------------------------

class _Checker:
    def __init__(self, source: str):
        self.source = source

    def at(self, line) -> str:
        return f"{self.source}:{line}" if line else self.source

    def fail(self, line, key, problem):
        raise ConfigError(f"{self.at(line)}: {key}: {problem}")

    def mapping(self, node: _Node, key: str, allowed) -> dict:
        if not isinstance(node.value, dict):
            self.fail(node.line, key, f"expected a mapping, got {type(node.value).__name__}")
        for k, (_, line) in node.value.items():
            if k not in allowed:
                self.fail(line, f"{key}.{k}" if key else k, f"unknown key (known: {', '.join(allowed)})")
        return node.value

    def choice(self, entry, key, choices):
        node, line = entry
        if node.value not in choices:
            self.fail(line, key, f"{node.value!r} is not one of {', '.join(choices)}")
        return node.value

    def settings(self, fields: dict, key: str, sync_choices) -> Settings:
        s = Settings()
        if "sync" in fields:
            s.sync = self.choice(fields["sync"], f"{key}.sync", sync_choices)
        if "placement" in fields:
            s.placement = self.choice(fields["placement"], f"{key}.placement", PLACEMENTS)
        if "partition" in fields:
            s.partition = self.choice(fields["partition"], f"{key}.partition", PARTITIONS)
        if "compression" in fields:
            s.compression = self.choice(fields["compression"], f"{key}.compression", COMPRESSIONS)
        if "partitions" in fields:
            node, line = fields["partitions"]
            if not isinstance(node.value, int) or isinstance(node.value, bool):
                self.fail(line, f"{key}.partitions", f"expected an integer, got {node.value!r}")
            if node.value < 1:
                self.fail(line, f"{key}.partitions", f"must be >= 1, got {node.value}")
            s.partitions = node.value
        if "optimizer" in fields:
            s.optimizer = self.optimizer(fields["optimizer"], f"{key}.optimizer")
        if "staleness" in fields:
            node, line = fields["staleness"]
            if not isinstance(node.value, int) or isinstance(node.value, bool) or node.value < 0:
                self.fail(line, f"{key}.staleness", f"expected an integer >= 0 (steps; 0: synchronous), got {node.value!r}")
            s.staleness = node.value
        if "dynamic" in fields:
            s.dynamic = self.dynamic(fields["dynamic"], f"{key}.dynamic")
        if "storage" in fields:
            s.storage = self.storage(fields["storage"], f"{key}.storage")
        return s

    def storage(self, entry, key) -> dict:
        node, line = entry
        from .ps.storage import OPTION_KEYS, check_option, options  # (the table's own checks; see dynamic())

        fields = self.mapping(node, key, OPTION_KEYS)
        for k, (v, vline) in fields.items():
            try:
                check_option(k, v.value, "rule")
            except ValueError as exc:
                self.fail(vline, f"{key}.{k}", str(exc).split(": ", 1)[1].replace(f"storage.{k} ", ""))
        try:  # (what the keys say together: a disk tier needs both path and memory_rows)
            return options("rule", _plain(node))
        except ValueError as exc:
            self.fail(line, key, str(exc).split(": ", 1)[1])

    def dynamic(self, entry, key) -> dict:
        node, line = entry
        fields = self.mapping(node, key, DYNAMIC_KEYS)
        # (the checks are the dynamic table's own, made here too for file:line; imported here:
        # the ps package loads the C++ engine, which starts MPI)
        from .ps.dynamic_options import check_eviction, check_option

        out = {}
        for k, (v, vline) in fields.items():
            try:
                out[k] = check_option(k, v.value, "rule")
            except ValueError as exc:
                self.fail(vline, f"{key}.{k}", str(exc).split(": ", 1)[1].replace("None", "null"))
        if "capacity" in out:  # (else the table's own capacity applies: checked when it is made)
            try:
                check_eviction(out["capacity"], out.get("evict"), "rule")
            except ValueError as exc:
                self.fail(line, f"{key}.evict", str(exc).split(": ", 1)[1].replace("None", "null"))
        return out

    def optimizer(self, entry, key) -> dict:
        node, line = entry
        if isinstance(node.value, str):
            node = _Node({"name": (_Node(node.value, line), line)}, line)
        if not isinstance(node.value, dict) or "name" not in node.value:
            self.fail(line, key, "expected {name: sgd|adagrad|adam, <hyper-parameter>: <number>, ...}")
        name = self.choice(node.value["name"], f"{key}.name", OPTIMIZERS)
        hparams = {}
        for k, (v, vline) in node.value.items():
            if k == "name":
                continue
            if isinstance(v.value, bool) or not isinstance(v.value, (int, float)):
                self.fail(vline, f"{key}.{k}", f"expected a number, got {v.value!r}")
            hparams[k] = float(v.value)
        from . import _ps

        try:  # the C++ rule validates names and ranges: one source of truth
            _ps.optimizer_hyperparameters(name, hparams)
        except ValueError as exc:
            self.fail(line, key, str(exc))
        return {"name": name, **hparams}


def _parse(root: _Node, source: str) -> Config:
    c = _Checker(source)
    top = c.mapping(root, "", ("defaults", "variables", "strict", "backend", "auto_steps", "auto_trial_steps",
                                   "memory_per_rank"))
    cfg = Config(Settings(), Settings(), [], source=source)
    if "defaults" in top:
        node, line = top["defaults"]
        defaults = c.mapping(node, "defaults", ("dense", "sparse"))
        for kind, choices in (("dense", SYNC_DENSE), ("sparse", SYNC_SPARSE)):
            if kind in defaults:
                fields = c.mapping(defaults[kind][0], f"defaults.{kind}", DEFAULT_KEYS)
                setattr(cfg, kind, c.settings(fields, f"defaults.{kind}", choices))
                if kind == "dense" and cfg.dense.storage is not None:
                    c.fail(fields["storage"][1], "defaults.dense.storage", "storage applies to sparse tables on the "
                           "parameter server (set it under defaults.sparse or in a rule)")
                if kind == "dense" and cfg.dense.staleness:
                    c.fail(fields["staleness"][1], "defaults.dense.staleness", "dense variables stay synchronous "
                           "(bounded staleness applies to sparse tables on the parameter server)")
                cfg.where[f"defaults.{kind}"] = c.at(defaults[kind][1])
    if "variables" in top:
        node, line = top["variables"]
        if not isinstance(node.value, list):
            c.fail(line, "variables", "expected a list of rules (- match: ...)")
        for i, item in enumerate(node.value):
            fields = c.mapping(item, f"variables[{i}]", RULE_KEYS)
            if "match" not in fields:
                c.fail(item.line, f"variables[{i}]", "a rule needs 'match' (a glob on variable names)")
            match_node, match_line = fields["match"]
            if not isinstance(match_node.value, str) or not match_node.value:
                c.fail(match_line, f"variables[{i}].match", f"expected a glob string, got {match_node.value!r}")
            s = c.settings(fields, f"variables[{i}]", tuple(dict.fromkeys(SYNC_DENSE + SYNC_SPARSE)))
            cfg.rules.append(Rule(**dataclasses.asdict(s), match=match_node.value, where=c.at(item.line)))
    if "strict" in top:
        node, line = top["strict"]
        if not isinstance(node.value, bool):
            c.fail(line, "strict", f"expected true or false, got {node.value!r}")
        cfg.strict = node.value
    if "backend" in top:
        cfg.backend = c.choice(top["backend"], "backend", BACKENDS)
    if "auto_steps" in top:
        node, line = top["auto_steps"]
        if not isinstance(node.value, int) or isinstance(node.value, bool) or node.value < 1:
            c.fail(line, "auto_steps", f"expected an integer >= 1, got {node.value!r}")
        cfg.auto_steps = node.value
    if "auto_trial_steps" in top:
        node, line = top["auto_trial_steps"]
        if not isinstance(node.value, int) or isinstance(node.value, bool) or not (node.value == 0 or node.value >= 3):
            c.fail(line, "auto_trial_steps", f"expected 0 (no trials) or an integer >= 3, got {node.value!r}")
        cfg.auto_trial_steps = node.value
    if "memory_per_rank" in top:
        node, line = top["memory_per_rank"]
        try:
            cfg.memory_per_rank = parse_bytes(node.value, "memory_per_rank")
        except ValueError as exc:
            c.fail(line, "memory_per_rank", str(exc).split(": ", 1)[1])
    return cfg


def parse_bytes(value, where: str) -> int:
    """Bytes from an integer or a string like "512MiB", "8GiB", "100MB"; ValueError naming `where`."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected bytes (an integer or a size like '8GiB'), got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = (float(digits) if digits else -1.0), text[len(digits):]
    if unit not in units or number <= 0:
        raise ValueError(f"{where}: expected bytes (an integer or a size like '8GiB', '512MiB'), got {value!r}")
    return int(number * units[unit])


def _plan_as_config(d: dict, source: str) -> dict:
    """A plan written by explain --json, as a config dict: one exact rule per variable."""
    plans = d if isinstance(d, list) else [d]
    rules = []
    for plan in plans:
        for v in plan["variables"]:
            if not v.get("route"):
                continue
            rule = {"match": v["name"].replace("[", "[[]").replace("*", "[*]").replace("?", "[?]"), "sync": v["route"]}
            if (v.get("auto") or {}).get("status") == "measuring":  # not decided yet: it stays auto
                rule["sync"] = "auto"
                if v.get("optimizer") and v.get("optimizer_source") == "config":
                    rule["optimizer"] = v["optimizer"]
            elif v["route"] == "ps":
                rule.update(placement=v["placement"], partitions=v["shards"])
                if v.get("partition") in PARTITIONS:  # (a dynamic table's 'hash' is no choice: it has no other)
                    rule["partition"] = v["partition"]
                if v.get("dynamic"):
                    rule["dynamic"] = {k: v["dynamic"][k] for k in DYNAMIC_KEYS if k in v["dynamic"]}
                if v.get("storage"):
                    rule["storage"] = dict(v["storage"])
                if v.get("optimizer") and v.get("optimizer_source") == "config":
                    rule["optimizer"] = v["optimizer"]
                if v.get("staleness"):
                    rule["staleness"] = v["staleness"]
            elif v.get("compression") and v["route"] == "allreduce":
                rule["compression"] = v["compression"]
            rules.append(rule)
    out = {"variables": rules, "strict": True}
    backend = plans[0].get("backend") if plans else None
    if backend in BACKENDS:
        out["backend"] = backend
    return out


def load(config=None) -> Config | None:
    """A Config from a path, a dict, or (config=None) HYBRIDSYNC_CONFIG; None if there is none."""
    if isinstance(config, Config):
        return config
    if config is None:
        config = settings().config_path
        if config is None:
            return None
    if isinstance(config, dict):
        if "variables" in config and config["variables"] and "name" in config["variables"][0]:
            config = _plan_as_config(config, "<plan>")
        return _parse(_from_dict(config), "<dict>")
    path = os.fspath(config)
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None
    if path.endswith(".json") or text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if isinstance(data, list) or ("variables" in data and data["variables"] and "name" in data["variables"][0]):
            data = _plan_as_config(data, path)
        return _parse(_from_dict(data), path)
    return _parse(_compose(text, path), path)
