"""The optimizer: ``dmuon.Muon`` (``muon.py``), the per-matrix update and its hyperparameter records
(``update.py``), Newton–Schulz (``newton_schulz.py``) and its Triton kernel for symmetric products
(``_symmetric.py``). Everything but ``muon.py`` is pure tensor math, testable on one CPU."""

from .muon import Muon
from .update import AdamWHParams, AdjustLR, MuonHParams, adjusted_lr, muon_update_, muon_update_batch_

__all__ = ["Muon", "AdjustLR", "adjusted_lr", "MuonHParams", "AdamWHParams", "muon_update_", "muon_update_batch_"]
