"""DeepSpeed ZeRO stage 0, 1, 2 and 3 for models prepared by dmuon: ``deepspeed.initialize`` learns to leave the
dedicated params to dmuon. Needs deepspeed 0.19 (checked: 0.19.8); installed by ``dmuon.dedicate_params`` when the
script has already imported deepspeed (or by importing this package), the way ``import dmuon`` installs the FSDP2
patch::

    import deepspeed, dmuon
    dmuon.dedicate_params(model, mesh, predicate=...)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    for batch in loader:
        engine.backward(engine(batch).loss)
        engine.step()

What ``deepspeed.initialize`` (``DeepSpeedEngine.__init__``) does to such a model, and what this package does:

* It broadcasts every param's value from rank 0; a non-owner holds no value of a dedicated param
  (``NotHeldError``). **Skipped** for the dedicated params, which are already every rank's owner's.
* ZeRO flattens the client optimizer's param groups into one slice per rank and steps each group. It **gets** a
  torch ``AdamW`` over ``dmuon.Muon``'s groups of the other params (the same group dicts: a scheduler built on
  ``dmuon.Muon`` drives both); the Muon groups stay dmuon's. Since DeepSpeed has no way to leave a param out of
  its groups and still train it, everything dmuon needs of a step joins DeepSpeed's own optimizer object
  (``_drive.py``): the fp16 overflow check and the global norm count the dedicated gradients, and after ZeRO's
  step the owners unscale, clip (ZeRO's own factor) and update their matrices, unless the step overflowed. At
  stage 0 there is no ZeRO optimizer: DeepSpeed steps the facade itself and all-reduces, clips and clears
  gradients in the engine, whose methods for that change on the engine object instead ([Note: DeepSpeed
  stage 0] in ``_stage0.py``).
* Accumulation: dmuon's hooks ask the engine whether a backward closes the window
  (``is_gradient_accumulation_boundary``), so dedicated gradients are averaged once per step, at the boundary.
* Checkpoints: ``engine.save_checkpoint`` writes the model file from :func:`dmuon.get_model_state_dict` (every
  rank gathers, rank 0 writes) and every rank's ZeRO file carries its owned Muon state with its checksums (at
  stage 0, which writes no ZeRO files, the one optimizer dict rank 0 writes carries every rank's, gathered);
  ``load_checkpoint`` is all or nothing ([Note: atomic DeepSpeed loads] in ``_load.py``): every rank reads and
  checks what it needs, all agree, and only then does DeepSpeed's load run (put back on every rank should it
  still fail on one). A restart on the same ranks is bit-identical; on another world size, resume through
  dmuon's full state dicts (``docs/guides/deepspeed.md``).
* ``engine.step()`` runs ``dmuon.Muon.apply_update``, the update ``Muon.step`` runs (QK-clip included), with
  ZeRO's own step inside it.
* bf16 with fp32 gradient accumulation at stage 1 runs DeepSpeed's ``BF16_Optimizer`` instead of ZeRO's: its
  ``step``, ``zero_grad`` and ``get_grads_for_norm`` join the same way (the norm it sums gets the dedicated
  gradients' as one more term). A config ``"scheduler"`` sets the lr of ZeRO's groups; dmuon's follow at their
  ratio as built ([Note: DeepSpeed config schedulers] in ``_drive.py``).
* ZeRO-3 partitions every param it is given: while ``DeepSpeedEngine.__init__`` runs, the dedicated params are left
  out of every walk over the modules' params, and afterwards they carry ZeRO-3's marks of a whole, persistent
  param that its hooks never gather or free ([Note: DeepSpeed ZeRO-3] in ``_zero3.py``).
* Refused before anything changes, on every rank: bf16 / fp16 at stage 0, an optimizer other than
  the model's ``dmuon.Muon`` (DeepSpeed would put dedicated params in its groups), dedicated params of another
  dtype than the config's fp16 / bf16, optimizer offload to NVMe (to the CPU works: [Note: DeepSpeed optimizer
  offload] in ``_drive.py``), ``elastic_checkpoint``, model, tensor or sequence
  parallelism, and dmuon's HSDP, tensor-parallel or engine-sharded params.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

try:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"dmuon.integrations.deepspeed needs deepspeed ({e}); pip install deepspeed") from e

from ...runtime.hooks import STATE_ATTR
from ._checks import agree, problems, uses_cpu_adam
from ._drive import Drive
from ._zero3 import Zero3, hidden

__all__ = ["install", "uninstall", "is_installed"]

_MARK = "__dmuon_deepspeed__"
#: what the wrapper reads of ``DeepSpeedEngine.__init__``'s arguments
_EXPECTED = ("model", "optimizer", "model_parameters", "config_class")
#: the attribute DeepSpeed's ``_broadcast_model`` skips a param for ("unique per shard"; set while it runs)
_NO_BROADCAST = "ds_optim_param"


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        model = bound.arguments.get("model")
        state = getattr(model, STATE_ATTR, None)
        if state is None:  # not a dmuon model: DeepSpeed as it is
            original(*bound.args, **bound.kwargs)
            return
        optimizer = bound.arguments.get("optimizer")
        agree(problems(state, optimizer, bound.arguments.get("model_parameters"), bound.arguments["config_class"]))
        drive = Drive(state, optimizer, cpu_adam=uses_cpu_adam(bound.arguments["config_class"]))
        bound.arguments["optimizer"] = drive.facade  # ZeRO takes the other params' groups only
        dedicated = [dp.bound() for dp in state.dedicated()]
        for p in dedicated:
            setattr(p, _NO_BROADCAST, True)
        stage3 = int(bound.arguments["config_class"].zero_optimization_stage) == 3
        try:
            with hidden(state) if stage3 else contextlib.nullcontext():  # [Note: DeepSpeed ZeRO-3]
                original(*bound.args, **bound.kwargs)
        finally:
            for p in dedicated:
                if hasattr(p, _NO_BROADCAST):
                    delattr(p, _NO_BROADCAST)
        drive.attach(self)

    setattr(__init__, _MARK, True)
    return __init__


def is_installed() -> bool:
    """Whether ``deepspeed.initialize`` currently knows dmuon models.

    Example::

        from dmuon.integrations import deepspeed as dmuon_deepspeed
        assert dmuon_deepspeed.is_installed()     # importing the package installed it
    """
    return bool(getattr(DeepSpeedEngine.__init__, _MARK, False))


def install() -> None:
    """Teach ``deepspeed.initialize`` (``DeepSpeedEngine.__init__``) about dmuon models; idempotent. Importing this
    package calls it. Raises ``RuntimeError`` if this deepspeed lacks what the glue relies on.

    Example::

        import deepspeed
        from dmuon.integrations import deepspeed as dmuon_deepspeed   # dmuon.dedicate_params does this too
        assert dmuon_deepspeed.is_installed()
    """
    if is_installed():
        return
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    params = tuple(inspect.signature(DeepSpeedEngine.__init__).parameters)
    missing = [f"DeepSpeedEngine.__init__({p}=...)" for p in _EXPECTED if p not in params]
    missing += [f"DeepSpeedEngine.{n}" for n in Drive.ENGINE_METHODS if not callable(getattr(DeepSpeedEngine, n, None))]
    missing += [f"DeepSpeedZeroOptimizer.{n}" for n in Drive.ZERO_METHODS
                if not callable(getattr(DeepSpeedZeroOptimizer, n, None))]
    missing += [f"DeepSpeedZeroOptimizer_Stage3.{n}" for n in Zero3.ZERO_METHODS
                if not callable(getattr(DeepSpeedZeroOptimizer_Stage3, n, None))]
    missing += [f"DeepSpeedZeRoOffload.{n}" for n in Zero3.OFFLOAD_METHODS
                if not callable(getattr(DeepSpeedZeRoOffload, n, None))]
    missing += [f"BF16_Optimizer.{n}" for n in Drive.BF16_METHODS if not callable(getattr(BF16_Optimizer, n, None))]
    if missing:
        raise RuntimeError(
            f"dmuon.integrations.deepspeed supports deepspeed 0.19 (checked 0.19.8); deepspeed {deepspeed.__version__} "
            f"lacks: {', '.join(missing)}."
        )
    DeepSpeedEngine.__init__ = _wrap(DeepSpeedEngine.__init__)  # type: ignore[method-assign]


def uninstall() -> None:
    """Restore DeepSpeed's own ``DeepSpeedEngine.__init__`` (mainly for tests); models prepared by dmuon are then
    DeepSpeed's to break again (``NotHeldError`` in its initial broadcast).

    Example::

        dmuon_deepspeed.uninstall()
        dmuon_deepspeed.install()
    """
    if is_installed():
        DeepSpeedEngine.__init__ = DeepSpeedEngine.__init__.__wrapped__  # type: ignore[attr-defined]


install()
