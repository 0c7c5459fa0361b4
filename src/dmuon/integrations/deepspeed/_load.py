"""``engine.load_checkpoint`` of a dmuon model: all or nothing, on every rank.

[Note: atomic DeepSpeed loads]
DeepSpeed's ``load_checkpoint`` writes as it reads: the model file's params first (through dmuon's model setter,
which also restarts ZeRO's fp32 copies), the scheduler and the engine's counters, and only then does it compare
world sizes and read each rank's ZeRO file, whose dmuon part (the owners' Muon state) ``torch.load`` reads without
any check. A missing file on one rank, a checkpoint of another world size or a flipped byte in a momentum was found
late, on one rank, or never. dmuon's load instead runs in five steps:

1. *read and check*, on each rank, everything its load will read: the model file and this rank's ZeRO file (the
   one DeepSpeed reads; at stage 0 the model file holds every rank's part), the entries DeepSpeed looks up, the
   saved data-parallel world size, and dmuon's part (owner plan, writing rank, groups, checksums: ``_part.py``);
   no collective, nothing written;
2. *agree*: one gather, and every rank raises the same ``ValueError`` if any rank found a problem; then dmuon's
   model check (``check_model_sd``: keys, shapes, dtypes, checksums), which raises on every rank together too;
3. *stage*: a CPU copy of everything DeepSpeed's load writes (params and masters, Muon's state and groups, ZeRO's
   fp32 slices, moments, loss scaler and links, the scheduler, the engine's counters);
4. DeepSpeed's own load, given the files read in 1 (so it loads exactly what was checked, and reads each file once)
   and the checked model dict;
5. *agree on the outcome*: should DeepSpeed still raise on some rank (its own checks: a parameter alignment, a
   clip setting), every rank puts the staged copy back and raises. After 2 only local work remains (ZeRO-1/2 loads
   its own file), so a rank that fails cannot leave the others waiting in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint.model import ModelLoad, check_model_sd
from ...optim import Muon
from ...runtime import comm as C
from ...runtime.hooks import DMuonState
from ._checks import agreed
from ._part import STATE_KEY, part_of, part_problems

__all__ = ["Files", "Staged", "load_checkpoint", "read_and_check"]

#: the entries of the model file DeepSpeed reads when it loads more than the module
_ENGINE_ENTRIES = ("dp_world_size", "mp_world_size", "global_steps", "skipped_steps")


class Files:
    """The files one rank's load reads, read once: DeepSpeed's checkpoint engine is handed these objects."""

    def __init__(self) -> None:
        self.read: dict[str, Any] = {}

    def load(self, path: str, problems: list[str]) -> Any:
        """``path`` read on the CPU, or ``None`` with the reason in ``problems``."""
        if not os.path.isfile(path):
            problems.append(f"{path} does not exist on this rank; every rank needs the model file and its own ZeRO "
                            "file of the same save")
            return None
        try:
            self.read[path] = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any failure to read is this rank's finding, agreed below
            problems.append(f"{path} could not be read ({type(e).__name__}: {e})")
            return None
        return self.read[path]

    def serve(self, engine: Any) -> Callable[[], None]:
        """Until the returned undo runs: DeepSpeed's reads of these paths (the model file twice: its checkpoint
        list check, then the load) get the objects read here."""
        ckpt = engine.checkpoint_engine
        original = ckpt.load

        def load(path: str, map_location: Any = None) -> Any:
            return self.read[path] if path in self.read else original(path, map_location=map_location)

        ckpt.load = load

        def undo() -> None:
            if "load" in vars(ckpt):
                del ckpt.load
            self.read.clear()

        return undo


def _zero_file(engine: Any, load_dir: str, tag: str) -> str:
    """The ZeRO file DeepSpeed reads for this rank (its older name where only that exists)."""
    path = engine._get_zero_ckpt_name(load_dir, tag)
    old = path.replace("_optim_states.pt", "optim_states.pt")
    return old if not os.path.exists(path) and os.path.exists(old) else path


def _model_problems(sd: Any, engine: Any, path: str, *, counters: bool, optimizer: bool, scheduler: bool
                    ) -> list[str]:
    if not isinstance(sd, Mapping) or not isinstance(sd.get("module"), Mapping):
        return [f"{path} holds no 'module' state dict"]
    out = [f"{path} lacks {k!r}" for k in (_ENGINE_ENTRIES if counters else ("dp_world_size",)) if k not in sd]
    if optimizer and "dp_world_size" in sd and sd["dp_world_size"] != engine.seq_dp_world_size:
        out.append(f"the checkpoint was saved on {sd['dp_world_size']} data-parallel ranks and this job has "
                   f"{engine.seq_dp_world_size}; ZeRO's files and dmuon's owner plan are per rank. Resume on another "
                   "world size through dmuon's full state dicts (dmuon.get_state_dict / set_state_dict, "
                   "docs/guides/deepspeed.md), or load the model alone (load_module_only=True)")
    if scheduler and not isinstance(sd.get("lr_scheduler"), Mapping):
        out.append(f"{path} holds no lr_scheduler state, but this engine has a scheduler: pass "
                   "load_lr_scheduler_states=False to keep the scheduler as it is")
    return out


def read_and_check(engine: Any, state: DMuonState, muon: Muon, load_dir: str, tag: str, *,
                   counters: bool, optimizer: bool, scheduler: bool) -> tuple[Files, dict[str, Any] | None, list[str]]:
    """Step 1 of [Note: atomic DeepSpeed loads] on this rank: the files read, the model file's dict, the problems."""
    files, problems = Files(), []
    if engine.load_universal_checkpoint():
        problems.append("DeepSpeed's universal checkpoints carry no dmuon part; load dmuon's full state dicts "
                        "(docs/guides/deepspeed.md)")
        return files, None, problems
    names = engine._get_all_ckpt_names(load_dir, tag)
    if len(names) != 1:
        problems.append(f"expected one model file under {os.path.join(load_dir, str(tag))}, found {len(names)}")
        return files, None, problems
    sd = files.load(names[0], problems)
    if sd is None:
        return files, None, problems
    problems += _model_problems(sd, engine, names[0], counters=counters, optimizer=optimizer, scheduler=scheduler)
    if not optimizer or problems:
        return files, sd, problems
    if int(engine.zero_optimization_stage()) == 0:  # the model file holds the optimizer, every rank's part in it
        saved = sd.get("optimizer")
        part = part_of(saved.get(STATE_KEY) if isinstance(saved, Mapping) else None, state.ctx.rank)
        problems += part_problems(part, state, muon, names[0])
        return files, sd, problems
    path = _zero_file(engine, load_dir, tag)
    zero = files.load(path, problems)
    if zero is not None:
        # ZeRO-1/2 keep the facade's dict as "base_optimizer_state", ZeRO-3 as "optimizer_state_dict"
        inner = (zero.get("optimizer_state_dict") or {}) if isinstance(zero, Mapping) else {}
        base = inner.get("optimizer_state_dict" if int(engine.zero_optimization_stage()) == 3 else
                         "base_optimizer_state") if isinstance(inner, Mapping) else None
        part = base.get(STATE_KEY) if isinstance(base, Mapping) else None
        problems += part_problems(part, state, muon, path)
    return files, sd, problems


# --------------------------------------------------------------------------------------------------- #
# Staging                                                                                              #
# --------------------------------------------------------------------------------------------------- #
def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class Staged:
    """Step 3: what DeepSpeed's load writes on this rank, copied; :meth:`restore` puts every object and value back."""

    #: the engine's and ZeRO's attributes a load replaces
    ENGINE_ATTRS = ("global_steps", "global_samples", "skipped_steps", "loaded_checkpoint_dp_world_size",
                    "loaded_checkpoint_mp_world_size")
    ZERO_ATTRS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "_hp_optimizer_states_linked")

    def __init__(self, engine: Any, state: DMuonState, muon: Muon, facade: Any) -> None:
        self.engine, self.state, self.muon, self.facade = engine, state, muon, facade
        zero = engine.optimizer  # the facade itself at stage 0
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, its copy)
        self.maps: list[tuple[dict, dict]] = []  # (live dict, its entries)
        not_mine = {id(dp.bound()) for dp in state.dedicated() if dp.owner != state.ctx.rank}  # 0 bytes here
        with torch.no_grad():
            for t in [*state.model.parameters(), *state.model.buffers()]:
                if id(t) not in not_mine:
                    self._tensor(t)
            for dp in state.owned():
                if dp.master is not None:
                    self._tensor(dp.master)
            slices = getattr(zero, "single_partition_of_fp32_groups", getattr(zero, "fp32_groups_flat_partition", ()))
            slices = [*slices, *getattr(zero, "fp32_partitioned_groups_flat", ()),  # ZeRO-3's, and its params'
                      *getattr(zero, "fp16_partitioned_groups_flat", ())]           # slices (the ds_tensors)
            for t in slices:  # ZeRO-1/2's, or BF16_Optimizer's
                if t is not None:
                    self._tensor(t)
            self._map(muon.state, deep=True)
            for g in muon.param_groups:  # dmuon's groups and the facade's (shared) group dicts
                self._map(g)
            self._map(facade.state, deep=True)
        self.facade_state, self.facade_groups = facade.state, facade.param_groups
        self.attrs = [(o, n, getattr(o, n)) for o, names in ((engine, self.ENGINE_ATTRS), (zero, self.ZERO_ATTRS))
                      for n in names if hasattr(o, n)]
        self.missing = [(o, n) for o, names in ((engine, self.ENGINE_ATTRS), (zero, self.ZERO_ATTRS))
                        for n in names if not hasattr(o, n)]
        self.links = [(p, getattr(p, "_hp_mapping", None))
                      for group in getattr(zero, "bit16_groups", getattr(zero, "bf16_groups", ())) for p in group]
        self.seen = [(dp, dp.seen_version) for dp in state.dedicated()]
        sched = engine.lr_scheduler
        self.scheduler = None if sched is None else _deep_copy(sched.state_dict())

    def _tensor(self, t: torch.Tensor) -> None:
        self.tensors.append((t, _copy(t)))

    def _map(self, m: dict, *, deep: bool = False) -> None:
        self.maps.append((m, dict(m)))
        for v in m.values():
            if deep and isinstance(v, dict):
                self._map(v)
            elif isinstance(v, torch.Tensor):
                self._tensor(v)

    @torch.no_grad()
    def restore(self) -> None:
        self.facade.state, self.facade.param_groups = self.facade_state, self.facade_groups
        for live, entries in self.maps:
            live.clear()
            live.update(entries)
        for live, saved in self.tensors:
            live.copy_(saved)
        for o, n, v in self.attrs:
            setattr(o, n, v)
        for o, n in self.missing:
            if hasattr(o, n):
                delattr(o, n)
        for p, link in self.links:
            p._hp_mapping = link
        for dp, seen in self.seen:
            dp.seen_version = seen
        if self.scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(self.scheduler)


def _deep_copy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _copy(x)
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_deep_copy(v) for v in x)
    return x


# --------------------------------------------------------------------------------------------------- #
# The load                                                                                             #
# --------------------------------------------------------------------------------------------------- #
def _tag(load_dir: str, tag: Any) -> Any:
    """The tag DeepSpeed would load: ``tag``, else the one its ``latest`` file names (``None``: no such file)."""
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def load_checkpoint(engine: Any, state: DMuonState, muon: Muon, facade: Any, original: Callable[..., Any],
                    checked: Callable[[ModelLoad | None], None], load_dir: str, tag: Any = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn: Any = None) -> Any:
    """``engine.load_checkpoint`` as [Note: atomic DeepSpeed loads] says; ``checked`` hands the checked model dict
    to the engine's ``load_module_state_dict`` (``None``: none any more). Collective."""
    kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                  custom_load_fn=custom_load_fn)
    resolved = _tag(load_dir, tag)
    if resolved is None:  # DeepSpeed warns that there is no 'latest' file and loads nothing
        return original(load_dir, tag, **kwargs)
    optimizer = load_optimizer_states and not load_module_only
    scheduler = not load_module_only and load_lr_scheduler_states and engine.lr_scheduler is not None
    files, sd, problems = read_and_check(engine, state, muon, load_dir, resolved, counters=not load_module_only,
                                         optimizer=optimizer, scheduler=scheduler)
    listed = agreed(problems)
    if listed is not None:
        raise ValueError(f"dmuon: engine.load_checkpoint({load_dir!r}, tag={resolved!r}) refused: {listed}. Nothing "
                         "was changed.")
    model = check_model_sd(state.model, sd["module"], what="engine.load_checkpoint")  # type: ignore[index]
    staged = Staged(engine, state, muon, facade)
    undo = files.serve(engine)
    checked(model)
    error: BaseException | None = None
    try:
        out = original(load_dir, resolved, **kwargs)
    except Exception as e:  # noqa: BLE001 - agreed below, then raised on every rank
        error = e
    finally:
        undo()
        checked(None)
    views = C.all_gather_default((dist.get_rank(), None if error is None else f"{type(error).__name__}: {error}"))
    failed = [(r, e) for r, e in views if e is not None]  # type: ignore[misc]
    if failed:
        staged.restore()
        listed = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise ValueError(f"dmuon: engine.load_checkpoint({load_dir!r}, tag={resolved!r}) failed inside DeepSpeed's "
                         f"load ({listed}). Every rank's model, optimizer, ZeRO and scheduler state was put back as "
                         "it was.") from error
    return out
