"""The optimizer: ``dmuon.Muon`` (``muon.py``), its update rules (``rules.py``: Muon's in ``update.py``, with the
per-matrix pieces every rule shares and the hyperparameter records; NorMuon's in ``normuon.py``; their
single-process oracles ``*_reference.py``), Newton–Schulz (``newton_schulz.py``) and its Triton kernel for
symmetric products (``_symmetric.py``), MuonClip's QK-clip (``qk_clip.py``), and what each Muon route means
(``routes/``: one strategy per route, [Note: route strategies]). Everything but ``muon.py``, ``qk_clip.py`` and
``routes/`` is pure tensor math, testable on one CPU."""

from .muon import Muon
from .normuon import NorMuonHParams, normuon_update_batch_
from .rules import Algorithm
from .update import AdamWHParams, AdjustLR, MuonHParams, adjusted_lr, decay_, muon_update_, muon_update_batch_

__all__ = ["Muon", "Algorithm", "AdjustLR", "adjusted_lr", "MuonHParams", "NorMuonHParams", "AdamWHParams",
           "muon_update_", "muon_update_batch_", "normuon_update_batch_", "decay_"]
