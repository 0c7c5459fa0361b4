"""Shared pieces of the Muon-variant tests (NorMuon, cautious weight decay): the single-process oracles written
from the papers' formulas (``dmuon/optim/*_reference.py``) driven from dmuon's hyperparameter records."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dmuon.optim import MuonHParams
from dmuon.optim.muon_reference import MuonReference
from dmuon.optim.normuon_reference import NorMuonReference


def reference_optimizer(params: Iterable, hp: MuonHParams) -> torch.optim.Optimizer:
    """The oracle optimizer of ``hp``'s algorithm with ``hp``'s values (``params``: tensors or torch groups)."""
    kwargs = dict(lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov, weight_decay=hp.weight_decay,
                  cautious_weight_decay=hp.cautious_weight_decay, ns_steps=hp.ns_steps,
                  ns_coefficients=hp.ns_coefficients, eps=hp.eps, adjust_lr_fn=hp.adjust_lr_fn.value)
    if hp.ALGORITHM == "normuon":
        return NorMuonReference(params, beta2=hp.beta2, normuon_eps=hp.normuon_eps,  # type: ignore[attr-defined]
                                rms_target=hp.rms_target, **kwargs)  # type: ignore[attr-defined]
    return MuonReference(params, **kwargs)
