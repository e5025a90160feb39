"""Adaptive batch size and learning rate from the gradient noise scale (Pollux/AdaptDL's
goodput), framework-neutral: the frontends and the sync core only feed it numbers.

gns.py         gradient statistics |G|^2 and tr(Sigma) from small- and large-batch gradient norms
scaling.py     learning-rate scaling rules (AdaScale gain, square root, linear)
goodput.py     the throughput model fitted from step times, statistical efficiency, batch choice
collect.py     what the sync core records each step (dense all-reduce in/out, PS round scalars)
rows.py        each PS table's distinct rows across batch sizes: the batch its row updates average
controller.py  one optimizer's adaptive state: stats, rule, scale-invariant progress, batch
"""
from .gns import GradientStats, estimate
from .scaling import RULES, rule_for
from .goodput import BatchChoice, ThroughputModel, efficiency, choose_batch
from .controller import Adaptive, AdaptiveConfig

__all__ = ["GradientStats", "estimate", "RULES", "rule_for", "BatchChoice", "ThroughputModel", "efficiency",
           "choose_batch", "Adaptive", "AdaptiveConfig"]
