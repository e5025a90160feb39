"""python -m hybridsync explain [CONFIG] --model module:factory [--world-size N] [--json OUT]

Prints the plan a DistributedOptimizer would make for the model (one row per variable, with
why each route was chosen) without launching anything; --json writes it, and that file loads
back as a config (`config=OUT`), so a strategy can be kept, reviewed and shared. --world-size N
plans a job of N ranks on this host: its tables' shards and its dense backend as that job's.

factory() returns a model, or (model, optimizer); with a model alone the optimizer is
--optimizer (sgd | adagrad | adam) with --lr.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"--model must be module:factory, got {spec!r}")
    module_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"{module_name} has no {attr!r}") from None


def explain_command(args) -> int:
    import torch

    from . import comm, runtime
    from . import config as config_mod
    from .torch.optimizer import _named_parameters
    from .planning import render
    from .torch.variables import plan_for

    built = _load_factory(args.model)()
    model, optimizer = built if isinstance(built, tuple) else (built, None)
    if optimizer is None:
        make = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[args.optimizer]
        optimizer = make(model.parameters(), lr=args.lr)
    cfg = config_mod.load(args.config)
    runtime.init()
    world = args.world_size or runtime.world().size
    # As a job of `world` ranks on this host would choose (the model was built in a world of one)
    backend = comm.choose(args.backend or (cfg.backend if cfg else None), world_size=world)
    named = _named_parameters(optimizer, None, model)
    plan, _ = plan_for(optimizer, named, model, cfg, "none", backend, world, comm.why(backend))
    plan.offline = True
    print(render(plan))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(plan.dumps() + "\n")
        print(f"wrote {args.json} (load it back with config={args.json!r})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridsync", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="print (and --json write) the plan for a model")
    explain.add_argument("config", nargs="?", help="YAML config (or a plan written with --json)")
    explain.add_argument("--model", required=True, help="module:factory returning a model or (model, optimizer)")
    explain.add_argument("--world-size", type=int, default=0,
                         help="plan for this many ranks on this host (default: this job's)")
    explain.add_argument("--backend", choices=["horovod", "mpi"], default=None)
    explain.add_argument("--optimizer", choices=["sgd", "adagrad", "adam"], default="sgd")
    explain.add_argument("--lr", type=float, default=0.01)
    explain.add_argument("--json", metavar="OUT", help="also write the plan as JSON")
    args = parser.parse_args(argv)
    from .config import ConfigError

    try:
        return explain_command(args)
    except ConfigError as exc:
        print(f"hybridsync: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
