"""``dmuon.Muon``: Muon on each dedicated matrix's owner, AdamW for every other trainable parameter.

One ``torch.optim.Optimizer`` with real param groups (so ``torch.optim.lr_scheduler`` and HF schedulers
scale both), built from the model rather than a parameter list:

* ``kind="muon"``: the dedicated params this rank owns (possibly none);
* ``kind="adamw"``: FSDP2 DTensor shards;
* ``kind="adamw_replicated"``: plain params nobody shards (kept apart from DTensors because torch's
  foreach kernels refuse mixed lists).

By default there is one group of each kind, in that order; ``param_groups=[...]`` puts the user's groups
first ([Note: group layout] in ``dmuon/optim/groups.py``). AdamW is torch's own ``torch.optim.AdamW`` stepping
the AdamW groups; the Muon math mirrors ``torch.optim.Muon`` and lives in ``dmuon/optim/update.py``'s helpers.

Mixed precision (see [Note: master weights] in ``dmuon/runtime/precision.py``): Muon updates each owned matrix's
master when it has one (``dedicate_params(param_dtype=...)`` or ``master_dtype`` here), in the master's
dtype, and rounds the result into the parameter, which is what the next forward broadcasts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from .. import engines
from ..runtime import comm as C
from ..runtime.hooks import DMuonState
from ..runtime.param import DedicatedParam
from ..runtime.route import Route
from .newton_schulz import DEFAULT_EPS, DEFAULT_NS_STEPS, KELLER_JORDAN_COEFFICIENTS, Coefficients
from . import routes
from .routes import owner as owner_route, sharded as engine_muon
from .groups import ResolvedGroup, agree, canonical_name, check_settings, groups_view, resolve_groups, torch_groups
from .qk_clip import QKClip, QKClipper, agreement_view, clip_layout
from .rules import hparams_of, rule_of

__all__ = ["Muon"]


def _names(state: DMuonState, route: Route) -> list[str]:
    """The canonical FQNs of the params on ``route``."""
    if route is Route.MUON_SHARDED:
        return [canonical_name(fqn) for fqn in state.sharded_muon]
    return [canonical_name(dp.fqn) for dp in state.dedicated() if dp.route is route]


def _keyword_only_after_lr(init: Callable[..., None]) -> Callable[..., None]:
    """Refuse positional arguments after ``lr`` with an error that says why (the signature, which
    ``inspect`` reads through ``__wrapped__``, marks them keyword-only)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > 2:
            raise TypeError(
                f"dmuon.Muon takes the model and lr positionally and everything else by keyword; got "
                f"{len(args)} positional arguments. Write e.g. dmuon.Muon(model, 0.02, momentum=0.95, "
                "weight_decay=0.1): torch.optim.Muon's positional order (lr, weight_decay, momentum, ...) differs "
                "from the one dmuon used to have, so a positional call is refused rather than guessed."
            )
        init(self, *args, **kwargs)

    return wrapper


class Muon(torch.optim.Optimizer):
    r"""Muon for dedicated matrices (on their owner rank), AdamW for everything else.

    For each dedicated matrix :math:`W` with averaged gradient :math:`G` its owner computes

    .. math::
        B \leftarrow \mu B + G,\quad
        U \leftarrow \begin{cases} G + \mu B & \text{nesterov} \\ B & \text{otherwise}\end{cases},\quad
        W \leftarrow (1 - \gamma\lambda) W - \gamma\,s(W)\,\mathrm{NS}_k^{(a,b,c)}(U)

    (``B`` kept as ``lerp`` like ``torch.optim.Muon``; :math:`s` is ``adjust_lr_fn``'s shape factor), then
    the next forward broadcasts the new :math:`W`. Every other trainable parameter gets
    ``torch.optim.AdamW``.

    ``step()`` waits for the gradient reduces, updates, and leaves every rank ready for the next forward.
    Build it after ``fully_shard`` and after the model is materialised (after ``to_empty`` + init when
    using the meta device); built before ``fully_shard``, its first ``zero_grad`` / ``step`` raises.

    Everything after ``lr`` is keyword-only: ``torch.optim.Muon``'s positional order differs from the
    one dmuon had (its 4th is ``weight_decay``), so a positional call is refused rather than guessed.

    Args:
        model: the root module passed to :func:`dmuon.dedicate_params`.
        lr: Muon learning rate (default 0.02).
        momentum: Muon momentum :math:`\mu` (default 0.95).
        nesterov: Nesterov momentum (default True).
        ns_steps: Newton–Schulz iterations (default 5).
        ns_coefficients: ``(a, b, c)`` of the quintic (default Keller Jordan's, as torch), a per-step
            sequence of them, or a schedule name (``"keller_jordan"``, ``"polar_express"``).
        ns_backend: ``"auto"`` (default): on CUDA the float16 Gram form for matrices at least 1.5x as
            wide as tall, the float16 direct form otherwise, with the symmetric products on quack's
            kernel (Hopper+, ``dmuon[quack]``) or Triton's; on the CPU ``"direct"``. Measured on an H200:
            0.55x / 0.51x torch's NS time on the 1B / 8B shares at 8 ranks, 8x closer to the exact
            iteration (docs/benchmarks.md). ``"direct"``: torch's operation sequence in bfloat16, bit for bit
            ``torch.optim.Muon`` (what the oracle tests use). ``"direct_fp16"``, ``"gram"``: one form
            everywhere. See :func:`dmuon.newton_schulz`.
        eps: floor of the norm NS divides by (default 1e-7, as torch).
        weight_decay: decoupled weight decay for Muon params (default 0.0).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (``torch.optim.Muon``'s meaning).
        algorithm: the update rule of the Muon groups (default ``"muon"``; ``"normuon"``: NorMuon, per-row
            normalised, docs/guides/normuon.md); a param group may choose its own.
        cautious_weight_decay: decay only where the update has the parameter's sign (default False;
            docs/guides/cautious-weight-decay.md).
        beta2, normuon_eps, rms_target: NorMuon's (defaults 0.95, 1e-8, 0.2, as the paper's).
        qk_clip: a :class:`dmuon.QKClip` (MuonClip's QK-clip after every step; docs/guides/qk-clip.md) or None.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's ``lr``, ``betas``, ``eps``,
            ``weight_decay`` (defaults 1e-3, (0.9, 0.999), 1e-8, 0.01, as ``torch.optim.AdamW``).
        adamw_foreach, adamw_fused: passed to ``torch.optim.AdamW``.
        replicate_async: HSDP only: after the update each owner publishes the new tensor over the
            replicate group; ``True`` (default) returns without waiting (the first forward that needs it
            waits), ``False`` waits inside ``step()``. Results are identical either way.
        param_groups: groups the ``torch.optim`` way, each a dict with ``"params"`` (parameters as they are
            after ``fully_shard``, ``(name, param)`` pairs or FQNs), optionally ``"use_muon"`` (default:
            True when every param of the group is dedicated, False when none is), ``"name"``, and any
            ``"algorithm"``, and any hyperparameter of its algorithm: Muon's ``lr``, ``momentum``, ``nesterov``,
            ``ns_steps``, ``ns_coefficients``, ``eps``, ``weight_decay``, ``adjust_lr_fn``, ``ns_backend``,
            ``cautious_weight_decay`` (NorMuon's: those and ``beta2``, ``normuon_eps``, ``rms_target``), or AdamW's
            ``lr``, ``betas``, ``eps``, ``weight_decay``. Unset ones take this constructor's values
            (``adamw_*`` for AdamW groups). Params no group names take the defaults. A param in two groups,
            a dedicated matrix in an AdamW group, a non-dedicated or non-2-D param in a Muon group, an
            unknown key or FQN, a group whose ``params`` name nothing raise ``ValueError`` on every rank before
            anything is built. Every setting here and in the groups that changes the update must be the same on
            every rank (one gather at build compares them; nothing per step). Example::

                no_decay = [n for n, p in model.named_parameters() if p.ndim < 2]  # norms, biases
                optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, param_groups=[
                    {"params": no_decay, "weight_decay": 0.0},
                    {"params": ["tok_embeddings.weight", "lm_head.weight"], "lr": 3e-3, "weight_decay": 0.0},
                    {"params": [n for n in dmuon.get_dedicated_params(model) if "mlp" in n], "lr": 0.01},
                ])

        allow_empty_groups: accept a param group whose ``params`` name nothing (default False: it raises,
            naming the model's nearest names, since a filter that matched nothing would leave its params on
            the defaults without a word); for a group list shared between models.
        master_dtype: e.g. ``torch.float32`` for a bf16 model: each owner keeps a master copy in this
            dtype of every owned dedicated param that is narrower (optimizer state ``"master"``, made from
            the param at its first step, like ``momentum_buffer``), runs momentum (kept in this dtype),
            Newton–Schulz and the update on it, and rounds the result into the param, which is what is
            broadcast. A gradient reduced in a wider ``dedicate_params(reduce_dtype=...)`` feeds it
            unrounded. Masters are in ``state_dict()`` and in dmuon's optimizer state dicts. Default
            ``None``: no masters, params updated in their own dtype. Params given a ``param_dtype`` in
            ``dedicate_params`` already keep their own value on the owner and need no ``master_dtype``.
            It does not apply to the AdamW params: keep those fp32 and let FSDP2's
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` make the bf16 compute copies. Example::

                model = MyModel().to(torch.bfloat16)
                dmuon.dedicate_params(model, mesh, predicate, reduce_dtype=torch.float32)
                ...
                optimizer = dmuon.Muon(model, lr=0.02, master_dtype=torch.float32)

    Example::

        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
        for batch in loader:
            optimizer.zero_grad()
            model(batch).loss.backward()
            optimizer.step()
            scheduler.step()
    """

    @_keyword_only_after_lr
    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_coefficients: Coefficients = KELLER_JORDAN_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        weight_decay: float = 0.0,
        adjust_lr_fn: str | None = None,
        algorithm: str = "muon",
        cautious_weight_decay: bool = False,
        beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        rms_target: float | None = 0.2,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        adamw_foreach: bool | None = None,
        adamw_fused: bool | None = None,
        replicate_async: bool = True,
        ns_backend: str = "auto",
        master_dtype: torch.dtype | None = None,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        qk_clip: QKClip | None = None,
        allow_empty_groups: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"dmuon.Muon takes the model (after dmuon.dedicate_params), not {type(model).__name__}; "
                "it builds its param groups itself."
            )
        values = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                      eps=eps, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn, ns_backend=ns_backend,
                      cautious_weight_decay=cautious_weight_decay, beta2=beta2, normuon_eps=normuon_eps,
                      rms_target=rms_target)
        settings = dict(algorithm=algorithm, adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay, adamw_foreach=adamw_foreach, adamw_fused=adamw_fused,
                        master_dtype=master_dtype)
        state, checked = check_settings(model, values, settings)  # raised in _resolve's gather
        engines.activate_glue()  # deepspeed imported since dedicate_params: deepspeed.initialize must know us
        engine = engines.of(model)  # build-time engine detection; bound once the build passed
        model = state.model
        engine.check_optimizer()
        self._muon_values, self._allow_empty_groups = values, allow_empty_groups
        # every setting checked and agreed on with the groups, in one gather ([Note: settings agreement])
        resolved, clipped = self._resolve(model, state, param_groups, taken=(), first_index=0, with_defaults=True,
                                          checked=checked, qk_clip=qk_clip)
        #: MuonClip's QK-clip ([Note: QK-clip] in ``dmuon/optim/qk_clip.py``): its settings and last ``stats``
        self.qk_clip: QKClipper | None = None if qk_clip is None else QKClipper(qk_clip, clipped, state)
        state.bind_if_needed()
        internal = self._torch_groups(model, state, resolved)
        self._check_sharded([g for g, _ in internal], state)
        adamw_groups = [g for g, _ in internal if g["kind"] != "muon"]
        # torch's AdamW fills its defaults into these very dicts; sharing them lets schedulers that edit
        # our param_groups drive AdamW too.
        self._adamw = torch.optim.AdamW(adamw_groups, foreach=adamw_foreach, fused=adamw_fused,
                                        **self._adamw_defaults.group_entries())
        self._dmuon_state: DMuonState = state
        self.replicate_async = bool(replicate_async)
        #: See ``master_dtype`` above; fixed for the optimizer's lifetime (not a param-group setting).
        self.master_dtype: torch.dtype | None = master_dtype
        self._generation = state.generation
        #: The engine bound at build; checked until the first step (see :meth:`check_engine`).
        self._engine_at_build = engine
        #: ``Route.MUON_SHARDED`` params: the version each one's master last agreed with, by ``id(param)``
        self._sharded_seen: dict[int, int] = {}
        self._check_pending = True
        self._building = True
        super().__init__([g for g, _ in internal], defaults={})
        self._building = False
        self._adamw.state = self.state
        #: Per param group, every rank's FQNs (a Muon group's ``params`` are only the owned ones).
        self._group_fqns: list[tuple[str, ...]] = [names for _, names in internal]
        engines.bind(engine.wrapper)  # the plain params dmuon averages (none under DDP: it averages them)

    # ------------------------------------------------------------------ #
    # Param groups ([Note: group layout] in dmuon/optim/groups.py)         #
    # ------------------------------------------------------------------ #
    def _resolve(self, model: nn.Module, state: DMuonState, specs: Sequence[Mapping[str, Any]] | None, *,
                 taken: Sequence[str], first_index: int, with_defaults: bool,
                 checked: Any = None, qk_clip: Any = None) -> tuple[list[ResolvedGroup], list[Any]]:
        """Resolve user groups (and the defaults), after the constructor's settings (``checked``: what
        ``check_settings`` returned or raised) and QK-clip's layout (constructor only); every rank compares
        its answer, its error and every setting that changes the update with the others' ([Note: settings
        agreement] in ``groups.py``), so a setting that differs between ranks, or fails on one, raises on all
        of them. Unconditional: whether a rank passed
        ``param_groups`` is one of the things that may differ, and a gather that only some ranks entered
        would hang the others. Returns the groups and QK-clip's attentions."""
        stage, error, view = "dmuon.Muon", None, {}
        resolved: list[ResolvedGroup] = []
        clipped: list[Any] = []
        try:
            if checked is not None:  # raised here, so that a rank refusing a setting still reaches the gather
                if isinstance(checked, Exception):
                    raise checked
                self._muon_defaults, self._adamw_defaults, view = checked
                stage = "dmuon.QKClip"
                clipped = [] if qk_clip is None else clip_layout(qk_clip, model, state)
                view.update(agreement_view(qk_clip, clipped))
            stage = "dmuon.Muon: param_groups"
            resolved = resolve_groups(model, specs, dedicated=_names(state, Route.MUON) + _names(state, Route.MUON_SHARDED),
                                      owner_adamw=_names(state, Route.ADAMW_OWNER),
                                      muon_defaults=self._muon_defaults, adamw_defaults=self._adamw_defaults,
                                      muon_values=self._muon_values, allow_empty=self._allow_empty_groups,
                                      taken=taken, first_index=first_index, with_defaults=with_defaults)
            view.update(groups_view(resolved))
        except Exception as e:  # noqa: BLE001 - any local failure must reach the gather, or the peers wait in it
            error = e
        # over every rank of the job: under TP, an error on one tp index's ranks stops the others too
        views = C.all_gather_object(state.ctx, (stage, None if error is None else f"{type(error).__name__}: {error}",
                                                view))
        if error is not None:
            raise error
        agree(views, "dmuon.Muon" if checked is not None else "dmuon.Muon.add_param_group",  # type: ignore[arg-type]
              stage_of_rank=state.topology.stage_of_rank() if state.topology.pipelined else None)  # within a stage
        return resolved, clipped

    def _torch_groups(self, model: nn.Module, state: DMuonState, resolved: Sequence[ResolvedGroup]
                      ) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
        """Internal torch groups with their global FQNs (Muon groups spelled as the dedicated FQNs)."""
        fqn_of = {canonical_name(dp.fqn): dp.fqn for dp in state.dedicated()}
        params = {canonical_name(n): p for n, p in model.named_parameters()}
        params.update({canonical_name(dp.fqn): dp.bound() for dp in state.owned()})
        owned = {canonical_name(dp.fqn) for dp in state.owned()}
        owner_adamw = set(_names(state, Route.ADAMW_OWNER))
        sharded = set(_names(state, Route.MUON_SHARDED))
        out = []
        for group in resolved:
            for g, names in torch_groups(group, params, owned, owner_adamw, sharded):
                if g["kind"] in ("muon", "adamw_owned"):  # dedicated: their names at dedicate_params
                    g["param_names"] = [fqn_of.get(n, n) for n in g["param_names"]]
                    names = tuple(fqn_of.get(n, n) for n in names)
                out.append((g, names))
        return out

    def _check_sharded(self, groups: Sequence[Mapping[str, Any]], state: DMuonState) -> None:
        layouts = engine_muon.layouts(state)
        engine_muon.check_sharded_params({n: p for g in groups if g["kind"] == "muon"
                                          for n, p in zip(g["param_names"], g["params"]) if n in layouts}, layouts)

    def group_fqns(self) -> list[tuple[str, ...]]:
        """Every rank's FQNs per param group, in ``param_groups`` order (a Muon group's ``params`` hold only
        the matrices this rank owns; this lists them all). Same on every rank.

        Example::

            for group, names in zip(optimizer.param_groups, optimizer.group_fqns()):
                print(group["name"], group["kind"], group["lr"], len(names))
        """
        return list(self._group_fqns)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group, resolved and checked like the constructor's ``param_groups`` (collective).

        Every trainable parameter is already in a group (the defaults take what no group names), so this
        is for parameters that were frozen when the optimizer was built and are trained now::

            model.tok_embeddings.weight.requires_grad_(True)
            optimizer.add_param_group({"params": ["tok_embeddings.weight"], "lr": 1e-4})
        """
        if getattr(self, "_building", False):
            super().add_param_group(param_group)
            return
        state = self._dmuon_state
        taken = [n for names in self._group_fqns for n in names]
        (group,), _ = self._resolve(state.model, state, [param_group], taken=taken,
                                    first_index=len(self.param_groups), with_defaults=False)
        internal = self._torch_groups(state.model, state, [group])
        self._check_sharded([g for g, _ in internal], state)
        for g, names in internal:
            if g["kind"] != "muon":
                self._adamw.add_param_group(g)
            super().add_param_group(g)
            self._group_fqns.append(names)
        engines.bind(state.engine.wrapper if state.engine is not None else state.model)  # newly trainable params

    # ------------------------------------------------------------------ #
    # Mixed precision                                                      #
    # ------------------------------------------------------------------ #
    def state_master_dtype(self, dp: DedicatedParam) -> torch.dtype | None:
        """Dtype of the optimizer-state ``"master"`` of ``dp`` (``None``: it has none). Same on every rank.
        AdamW params (``adamw_owner`` ones too) have none: ``master_dtype`` is Muon's."""
        return owner_route.master_dtype_of(dp, self.master_dtype)

    def update_dtype(self, dp: DedicatedParam) -> torch.dtype:
        """The dtype Muon updates ``dp`` in, and keeps its momentum in. Same on every rank."""
        return owner_route.update_dtype(dp, self.master_dtype)

    def _routes(self) -> routes.StepContext:
        """What the routes read and write of this optimizer ([Note: route strategies]); ``self.state`` is a new
        dict after ``load_state_dict``, so made afresh for each use."""
        return routes.StepContext(self._dmuon_state, self.state, self.master_dtype, self._sharded_seen)

    # ------------------------------------------------------------------ #
    # The surface checkpoints, diagnostics and engine glue use             #
    # ------------------------------------------------------------------ #
    @property
    def runtime(self) -> DMuonState:
        """The dmuon runtime of the model this optimizer was built for (read-only: ``dedicate_params`` built it,
        its own methods change it). Checkpoints, diagnostics and the engine glue check and read it here.

        Example::

            assert optimizer.runtime.model is model  # built for this model
        """
        return self._dmuon_state

    def check_engine(self) -> None:
        """Until the first step: refuse a model that ``fully_shard`` wrapped after this optimizer was built.
        ``fully_shard`` swaps the model's other params for DTensors, so the AdamW groups would hold stale
        objects and the embedding, norms and head would never train. (Re-resolving the params here instead
        is unsafe: while FSDP2 holds a module unsharded, the module lists its unsharded params.) Local.

        Example (what the state-dict functions run first)::

            optimizer.check_engine()  # raises if fully_shard wrapped the model after dmuon.Muon was built
        """
        if self._check_pending:
            engines.check_unchanged(self._engine_at_build)

    @property
    def adamw_kernels(self) -> dict[str, bool | None]:
        """The ``foreach`` / ``fused`` choices of this optimizer's AdamW, for an engine's own AdamW over its groups.

        Example::

            facade = torch.optim.AdamW(groups, **optimizer.adamw_kernels)
        """
        return {k: self._adamw.defaults.get(k) for k in ("foreach", "fused")}

    def leave_adamw_to_engine(self) -> None:
        """From now on this optimizer's AdamW steps only the owners' ``adamw_owned`` groups: an engine that steps
        the groups of the params it trains itself (DeepSpeed's ZeRO, [Note: DeepSpeed step]) calls it once.

        Example (dmuon's DeepSpeed glue, once ``deepspeed.initialize`` built the engine)::

            optimizer.leave_adamw_to_engine()
        """
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw_owned"]

    def _owned(self) -> dict[int, DedicatedParam]:
        return {id(dp.param): dp for dp in self._dmuon_state.owned()}

    def materialise_state(self) -> None:
        """Create the zero state a first step would create, so sharded dicts have the same keys before and
        after training starts (DCP loads into existing tensors). Mathematically a no-op; local.

        Example (what ``dmuon.get_optimizer_state_dict(..., sharded=True)`` does first)::

            optimizer.materialise_state()
            assert all(optimizer.state[p] for g in optimizer.param_groups for p in g["params"])
        """
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        rules = {id(p): rule_of(g) for g in self.param_groups if g["kind"] == "muon" for p in g["params"]}
        ctx = self._routes()
        for dp in self._dmuon_state.owned():  # the owners' matrices first, then the engine's shards
            if dp.route is Route.MUON:
                routes.of(dp).materialise_(ctx, routes.Member(dp.fqn, dp.bound(), dp), rules[id(dp.bound())])
        for g in self.param_groups:
            if g["kind"] == "muon":
                for strategy, members in routes.members(g, ctx.runtime, owned={}):  # (no owned: the shards only)
                    for m in members:
                        strategy.materialise_(ctx, m, rule_of(g))
                continue
            if not any(g is h for h in self._adamw.param_groups):  # an engine steps it (DeepSpeed's ZeRO)
                continue
            for p in g["params"]:
                st = self.state[p]
                if len(st) == 0:
                    on_device = g.get("fused") or g.get("capturable")
                    st["step"] = torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if g.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, except that Muon state stays in :meth:`update_dtype`
        (torch would round an fp32 master and momentum to a bf16 param's dtype)."""
        saved_groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
        wide: list[tuple[Tensor, torch.dtype, dict[str, Any], dict]] = []  # (param, dtype, saved entry, group)
        if len(saved_groups) == len(self.param_groups):
            owned = self._owned()
            for group, saved in zip(self.param_groups, saved_groups):
                if group["kind"] != "muon":
                    continue
                for p, pid in zip(group["params"], saved["params"]):
                    entry = state_dict["state"].get(pid, {})
                    dp = owned.get(id(p))
                    if dp is None:  # on the engine's shards
                        dtype = engine_muon.master_dtype_of(p, self.master_dtype)
                        if entry:
                            wide.append((p, dtype or p.dtype, entry, saved))
                        continue
                    if "master" in entry and self.state_master_dtype(dp) is None:
                        raise ValueError(
                            f"dmuon.Muon.load_state_dict: the state of {dp.fqn} has a 'master' but this optimizer "
                            f"keeps none for it ({dp.dtype}, master_dtype={self.master_dtype}); build dmuon.Muon "
                            "with the master_dtype the state was saved with. Nothing was loaded."
                        )
                    if entry:
                        wide.append((p, self.update_dtype(dp), entry, saved))
        super().load_state_dict(state_dict)
        for dp in self._dmuon_state.dedicated():
            dp.forget_master_version()  # new masters: compare them with the params once at the next step
        for p, dtype, entry, group in wide:
            for k, want in {"master": dtype, **rule_of(group).state_dtypes(dtype)}.items():
                if k in entry:
                    self.state[p][k] = entry[k].to(device=p.device, dtype=want)
        self._sharded_seen.clear()  # new masters: compare them with the params once at the next step
        # Optimizer.load_state_dict builds new group dicts and a new state map: re-share them with AdamW.
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] != "muon"]
        self._adamw.state = self.state

    def replace_state(self, new_state: dict[Tensor, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """What ``dmuon.set_optimizer_state_dict`` ends with, once it validated and placed every tensor: this
        rank's whole state and each group's hyperparameters (``params`` and ``param_names`` stay this rank's).
        Local; no check of its own, so use the state-dict functions unless you placed the tensors yourself.

        Example (the state kept, the hyperparameters of a saved ``param_groups`` list put back)::

            optimizer.replace_state(dict(optimizer.state), saved_groups)
        """
        for g, src in zip(self.param_groups, groups):
            for k, v in src.items():
                if k not in ("params", "param_names"):
                    g[k] = v
        self.state.clear()
        self.state.update(new_state)
        self._sharded_seen.clear()
        for dp in self._dmuon_state.dedicated():
            dp.forget_master_version()  # new masters: compare them with the params once at the next step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, plus every dedicated gradient this rank holds: non-owners'
        local ones (inside ``no_sync``), the owners' wide ``main_grad`` and gradients set aside during
        accumulation. Reduces still in flight are finished first, so none lands in ``.grad`` afterwards."""
        self.check_engine()
        self._dmuon_state.finish_reduces()
        super().zero_grad(set_to_none)
        self._dmuon_state.clear_grads(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Wait for gradient reduces, apply Muon (owners) and AdamW, publish (HSDP), drop stale copies."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self._dmuon_state
        if state.generation != self._generation:
            raise RuntimeError(
                "dmuon.Muon: the model's dedicated parameters were replaced after this optimizer was built "
                "(e.g. by to_empty()); build dmuon.Muon after materialising the model."
            )
        self.check_engine()
        if getattr(state.engine, "drives_step", False):
            raise RuntimeError(
                f"dmuon.Muon.step() on a model the {state.engine.kind} engine trains: its step() runs this "
                "optimizer's (engine.step() after engine.backward(loss)); a step of dmuon.Muon alone would leave "
                "the engine's params behind."
            )
        self.apply_update()
        return loss

    @torch.no_grad()
    def apply_update(self, *, engine_step: Callable[[], bool] | None = None) -> None:
        """One step's update on every rank: what :meth:`step` runs, and what an engine that runs the step itself
        calls (DeepSpeed's ``engine.step()``, through dmuon's glue), so every engine gets the same update. Collective.

        Once every reduce has finished: QK-clip's maxima gathered (it raises before anything changes);
        ``engine_step()``, the engine's own step of its params, whose ``False`` (an fp16 overflow) skips the rest;
        Muon and AdamW on the owners' matrices; AdamW on this optimizer's other params; QK-clip on the owners;
        then the new weights go out and non-owner copies are dropped.

        Example (dmuon's DeepSpeed glue, inside ZeRO's ``step``)::

            def engine_step() -> bool:
                zero_step()                  # ZeRO's AdamW on its own slices
                return not zero.overflow     # an overflow skips dmuon's part too

            optimizer.apply_update(engine_step=engine_step)
        """
        self._dmuon_state.run_step(lambda: self._update(engine_step), wait_publish=not self.replicate_async)

    def _update(self, engine_step: Callable[[], bool] | None) -> None:
        """:meth:`apply_update` once the runtime has every averaged gradient in place, before it publishes."""
        maxima = None if self.qk_clip is None else self.qk_clip.gather()
        if engine_step is not None and not engine_step():
            return
        self._update_owned()
        self._adamw.step()
        if maxima is not None:
            self.qk_clip.apply_(maxima, functools.partial(owner_route.update_target, self._routes()))  # type: ignore[union-attr]
        self._check_pending = False

    def _update_owned(self) -> None:
        """The dedicated params this rank owns: Muon's groups, and AdamW's ``adamw_owned`` ones made ready."""
        owned = self._owned()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._step_muon_group(group, owned)
            elif group["kind"] == "adamw_owned":
                for p in group["params"]:  # a gradient reduced in a wider dtype: AdamW reads .grad
                    grad = owned[id(p)].reduced_grad()
                    if p.grad is None and grad is not None:
                        p.grad = grad.to(p.dtype)

    def _step_muon_group(self, group: dict[str, Any], owned: dict[int, DedicatedParam]) -> None:
        """Each route's params of the group, its own way ([Note: route strategies] in ``optim/routes/base.py``)."""
        hp, rule, ctx = hparams_of(group), rule_of(group), self._routes()  # the group's algorithm (rules.py)
        for strategy, members in routes.members(group, ctx.runtime, owned):
            strategy.update_(ctx, members, hp, rule)
