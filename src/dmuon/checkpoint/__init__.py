"""State dicts for models and optimizers prepared by dmuon: full (topology-free) or sharded (for DCP).

*Full* dicts hold complete tensors keyed by the model's own FQNs, exactly what a single-process
``model.state_dict()`` would give, so they load into a plain model, save with ``torch.save`` or
safetensors, and restore on any number of ranks with any owner assignment. *Sharded* dicts
(``sharded=True``) are for ``torch.distributed.checkpoint``: FSDP2 params as DTensors, each dedicated
tensor only on its owner, nothing gathered to one rank.

Every function here is collective (call it on all ranks), drains pending dmuon work first and issues
the same collectives in the same order on every rank. The setters validate the whole input before
changing anything; on any mismatch every rank raises the same ``ValueError``.

Loading with DCP: ``dcp.load`` writes into the dict it is given, so its target is a *staged* sharded dict
(``sharded=True, staged=True``: copies, on the CPU by default), and the live model and optimizer change
only once the setter's checks, checksums included, have passed ([Note: staged loads] in ``_common.py``).
:func:`get_state_dict` / :func:`set_state_dict` take the model and optimizer together
(``{"model": ..., "optim": ...}``) and check both halves before writing either, so a checkpoint refused
in one half changes neither.

Mixed precision: a dedicated param given a ``param_dtype`` by ``dedicate_params`` appears in model dicts
with its owner's master value in its own dtype (as FSDP2's ``MixedPrecisionPolicy`` keeps fp32 sharded
params), and loading writes the master and rounds it into the compute copy. ``dmuon.Muon(master_dtype=...)``
masters are optimizer state (``"master"``, beside ``momentum_buffer``, both in the master dtype).

Tensor parallelism (a ``("dp", "tp")`` mesh): full dicts hold each TP matrix and its momentum whole (the
owner slot's shards gathered over "tp"), the same dict a dp-only run gives, and loading gives each rank
of the owner slot its slice; sharded dicts hold each owner-slot rank's shard as a DTensor over "tp", so
DCP records its offsets and any other dp x tp layout (dp-only too) loads it. See [Note: tensor-parallel
state dicts] in ``_common.py``.

Layout: ``model.py`` and ``optimizer.py`` hold the two pairs of functions (each setter split into a check
and an apply step), ``combined.py`` the pair for both at once, ``_common.py`` what they share.
"""

from .combined import get_state_dict, set_state_dict
from .model import get_model_state_dict, set_model_state_dict
from .optimizer import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "get_state_dict",
    "set_state_dict",
]
