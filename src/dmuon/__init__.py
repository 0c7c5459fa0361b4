"""dmuon: Muon at scale on FSDP2 by giving every weight matrix one owner rank.

``import dmuon`` patches FSDP2 so ``fully_shard`` skips the parameters ``dedicate_params`` selects.
"""

from __future__ import annotations

from . import diagnostics, qk_clip
from .engines.fsdp2 import install_patch, is_patch_installed, uninstall_patch
from .accumulate import no_sync
from .api import (
    broadcast_all_updates,
    get_dedicated_params,
    get_owned_grads,
    get_owned_params,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from .clip import clip_grad_norm_, install_torch_clip_routing
from .checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .dedicate import dedicate_params
from .optim.newton_schulz import newton_schulz
from .optim import Muon
from .optim.qk_clip import QKClip, QKHeads
from .partition import OwnerPlan
from .runtime.group import GroupState
from .runtime.guard import NotHeldError, OutsideBoundaryError
from .runtime.route import Route

__all__ = [
    "Muon",
    "QKClip",
    "QKHeads",
    "OwnerPlan",
    "GroupState",
    "NotHeldError",
    "OutsideBoundaryError",
    "Route",
    "broadcast_all_updates",
    "clip_grad_norm_",
    "dedicate_params",
    "diagnostics",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_owned_grads",
    "get_owned_params",
    "get_state_dict",
    "install_patch",
    "is_patch_installed",
    "newton_schulz",
    "no_sync",
    "qk_clip",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "uninstall_patch",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]

__version__ = "0.1.0"

install_patch()
install_torch_clip_routing()
