"""The adaptive state as explain() prints it."""
from __future__ import annotations

import math


def _num(x, fmt: str = ".4g") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def describe(s: dict) -> list[str]:
    """Lines for an Adaptive.summary()."""
    accumulation = f" x {s['accumulation']} accumulation steps" if s.get("accumulation", 1) > 1 else ""
    tables = [f"  table {name}: d {_num(t['duplicates'], '.2f')} rows pushed per row updated, distinct rows ~ "
              f"batch^{_num(t['growth'], '.2f')}, so a row update averages {_num(t['row_scale'], '.3g')}x the base "
              f"batch's hits; noise scale {_num(t['noise_scale'])}, efficiency {_num(t['efficiency'], '.1%')}; "
              f"LR x {_num(t['lr_factor'], '.3f')} (an Adagrad or Adam server rule; SGD takes the batch's)"
              for name, t in sorted(s.get("tables", {}).items())]
    rescales = [f"  Adagrad accumulators rescaled at step {r['step']}: batch {r['from']} -> {r['to']}, noise scale "
                f"{_num(r['noise_scale'])}, factor {_num(r['factor'])}" if r.get("applied") else
                f"  Adagrad accumulators not rescaled at step {r['step']} (batch {r['from']} -> {r['to']}): "
                f"{r.get('reason', '')}" for r in s.get("rescales", [])[-5:]]
    if s.get("rescale_accumulators"):
        rescales.insert(0, f"  Adagrad accumulators rescaled at each batch change: {len(s.get('rescales', []))} so far "
                           "(rescale_accumulators; docs/adaptive.md)")
    return [
        "adaptive batch size and learning rate (hybridsync.adaptive)",
        f"  noise scale {_num(s['noise_scale'])} samples  (|G|^2 {_num(s['sqr'])}, tr(Sigma) {_num(s['var'])} per sample)",
        f"  batch {s['global_batch']} = {s['local_batch']} per rank{accumulation}; base batch {s['base_batch']}, "
        f"scale {_num(s['scale'], '.3g')}",
        f"  gain {_num(s['gain'], '.3f')} base steps per step (statistical efficiency {_num(s['efficiency'], '.1%')}); "
        f"rule {s['rule'] or 'none'}, LR x {_num(s['lr_factor'], '.3f')}; progress {_num(s['progress'], '.1f')} "
        f"base steps in {s['steps']} steps",
        f"  efficiency model {s.get('efficiency_model', 'goodput')}: {s.get('efficiency_reason', '')}",
        f"  non-finite steps left out of the statistics: {s.get('nonfinite_steps', 0)} (inf / NaN gradients, "
        "e.g. an overflowed loss-scaled step)",
        *tables,
        *rescales,
    ]
