"""torch.distributed.pipelining's schedules on our sharded stages: gradients reduced once per step.

Upstream: no upstream issue found; a torch gap, not a bug. The schedules know torch's own ``FSDPModule`` only
(``isinstance`` checks in ``stage.py`` and ``schedules.py``, then its private state in the step-end reduction,
``perform_reduce_grad``; related: pytorch/pytorch#165106, FSDP's reduce-scatters moved to the step's end), and
from torch 2.13 the metadata inference runs a real backward per stage, which reduces our gradients (seen on
torch 2.13; related: pytorch/pytorch#177728, the stage's metadata inference reworked). Applies to torch 2.11 to
2.14.1, the supported range (the metadata-inference part from 2.13 on).

A schedule runs every micro-batch's backward without gradient sync and reduces at the step's end
(``perform_reduce_grad``), but only for modules it recognizes as torch's ``FSDPModule``, whose
private state it then reads. ``install`` makes it recognize ours too, through our public setters,
and gives its step end ours: sync back on, the gradients held since the first micro-batch reduced
once, the parameters resharded. It also refuses zero-bubble schedules on stages that reshard after forward,
whose weight gradients would be lost, and keeps the first step's metadata inference (torch 2.13 on: a real
forward and an input-gradient backward per stage, before the micro-batches) from reducing: one reduction per
group in every step, the first included.

``install_when_used`` (at each ``fully_shard``) installs it now if the program imported torch's pipelining
(the process-wide effect ``pipelining``), or else, if the program can import it, puts a ``sys.meta_path``
finder in place that installs it right after the import (``pipelining_import_hook``, gone once it fired);
fsdp_compose never imports it. A check at the first forward could not replace the finder: ``step()`` must
refuse a zero-bubble schedule on every rank before any communication, so before a later stage's first forward,
which waits for its input.
``FSDP_COMPOSE_DISABLE=pipelining`` keeps both out.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

from torch import nn

from ..api.module import FSDPModule
from .._runtime.hooks.backward import end_of_backward
from .._runtime.param_grad import clear_unsharded_grad
from .._runtime.process_wide import forget, install_once, process_wide_effects
from .._runtime.schedule import reshards_after_forward
from .._runtime.state import state_of, states_in

PACKAGE = "torch.distributed.pipelining"
STAGE, SCHEDULES = f"{PACKAGE}.stage", f"{PACKAGE}.schedules"
_OURS = "_fsdp_compose_step_end"
_WEIGHT_PASS = "_fsdp_compose_weight_pass"  # on a schedule: (the action lists read, whether one has a weight pass)



WHY = "torch.distributed.pipelining's schedules patched to reduce our stages' gradients once per step"
WHY_HOOK = "a sys.meta_path finder that installs 'pipelining' when the program imports torch.distributed.pipelining"


def install_when_used() -> None:
    """Teach ``torch.distributed.pipelining`` our modules: now if the program imported it, else a finder that
    does it right after the program does, if it can (nothing when pipelining cannot be imported)."""
    if sys.modules.get(STAGE) is not None:
        install_once("pipelining", WHY, install)
    elif "pipelining_import_hook" not in process_wide_effects() and importlib.util.find_spec(PACKAGE) is not None:
        # find_spec is None where the program cannot import it: not in this torch, or blocked (None in sys.modules)
        install_once("pipelining_import_hook", WHY_HOOK, _InstallOnImport.register, opt_out="pipelining")


def install() -> None:
    """Teach the imported ``torch.distributed.pipelining`` our modules (idempotent; torch's still work)."""
    stage = sys.modules[STAGE]
    for module in (stage, sys.modules.get(SCHEDULES)):
        if module is not None and hasattr(module, "FSDPModule"):  # its isinstance checks take a tuple
            known = module.FSDPModule if isinstance(module.FSDPModule, tuple) else (module.FSDPModule,)
            if FSDPModule not in known:
                module.FSDPModule = (*known, FSDPModule)
    _guard_weight_passes(sys.modules.get(SCHEDULES))
    base = stage._PipelineStageBase
    original = base.perform_reduce_grad
    if getattr(original, _OURS, False):
        return

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if not isinstance(self.submod, FSDPModule):
            return original(self, grad_scale_factor)
        finish_step(self.submod)
        if grad_scale_factor != 1:  # after the reduction, as torch orders it
            self.scale_grads(grad_scale_factor)
        return None

    setattr(perform_reduce_grad, _OURS, True)
    base.perform_reduce_grad = perform_reduce_grad
    inference = getattr(stage, "PipelineStage", None)
    if inference is not None and hasattr(inference, "_backward_metadata_inference"):
        inference._backward_metadata_inference = _unreduced(inference._backward_metadata_inference)


def _unreduced(metadata_backward: Callable) -> Callable:
    """The metadata inference's input-gradient backward on our stage, with gradient sync off: torch
    resets the stage after it (``_post_metadata_inference_cleanup``), so a reduction there is wasted,
    one more per group in the first step. Sync is put back as it was, and nothing is left held."""
    if getattr(metadata_backward, _OURS, False):
        return metadata_backward

    def without_reduction(self, *args, **kwargs):
        if not isinstance(self.submod, FSDPModule):
            return metadata_backward(self, *args, **kwargs)
        states = [state for _, state in states_in(self.submod)]
        syncing = [state.settings.requires_gradient_sync for state in states]
        self.submod.set_requires_gradient_sync(False)
        try:
            return metadata_backward(self, *args, **kwargs)
        finally:
            for state, sync in zip(states, syncing):
                state.settings.requires_gradient_sync = sync
                for p in state.group.trainable:
                    clear_unsharded_grad(p)

    setattr(without_reduction, _OURS, True)
    return without_reduction


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Runs ``install`` right after ``torch.distributed.pipelining`` (which imports its stage and
    schedules) is imported, for a program that imports it after ``fully_shard``."""

    @classmethod
    def register(cls) -> None:
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name, path, target=None):
        if name != PACKAGE:
            return None
        for finder in sys.meta_path:  # the spec the import would have found without us
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module) -> None:
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            forget("pipelining_import_hook")
            forget("pipelining")  # a fresh import: whatever was patched before is not this module
            install_once("pipelining", WHY, install)

        spec.loader.exec_module = exec_then_install
        return spec


def finish_step(module: nn.Module) -> None:
    """Reduce, once, the gradients the step's no-sync backwards held, and reshard: a step's end."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    root = state_of(module).root
    if root is not None:  # no forward ran yet: nothing is held
        end_of_backward(root, held=True)


def _guard_weight_passes(schedules) -> None:
    """Zero-bubble schedules compute weight gradients in a pass of their own (``W``), after the input
    gradients, on whatever ``parameters()`` the stage holds then: on a stage resharded after forward,
    the shards, so the gradients would be dropped (torch's FSDP2 trains wrong there, silently). Refuse
    it at ``step()``, on every rank before any communication."""
    multi = getattr(schedules, "PipelineScheduleMulti", None)
    if multi is None or getattr(multi.step, _OURS, False):
        return
    step = multi.step

    def checked_step(self, *args, **kwargs):
        _refuse_resharded_weight_pass(self)
        return step(self, *args, **kwargs)

    setattr(checked_step, _OURS, True)
    multi.step = checked_step


def _refuse_resharded_weight_pass(schedule) -> None:
    if not _has_weight_pass(schedule):
        return
    for stage in getattr(schedule, "_stages", []):
        if not isinstance(stage.submod, FSDPModule):
            continue
        for name, state in states_in(stage.submod):
            if reshards_after_forward(state, is_root=not name):
                raise ValueError(
                    f"{type(schedule).__name__} computes weight gradients in a pass of their own, after "
                    f"'{name or '<root>'}' of stage {stage.stage_index} was resharded: its gradients would be "
                    "lost. Call fully_shard with reshard_after_forward=False on that stage's modules"
                )


def _has_weight_pass(schedule) -> bool:
    """Whether the schedule's actions (``pipeline_order``: per rank, a list) hold a weight pass: read once
    per table, not at every step; a table loaded later (``_load_csv``) brings new lists and is read again."""
    order = getattr(schedule, "pipeline_order", None) or {}
    lists = tuple(order.values())
    seen = getattr(schedule, _WEIGHT_PASS, None)
    if seen is not None and len(seen[0]) == len(lists) and all(a is b for a, b in zip(seen[0], lists)):
        return seen[1]
    found = any(
        action is not None and getattr(action.computation_type, "name", "") == "BACKWARD_WEIGHT"
        for actions in order.values()
        for action in actions
    )
    setattr(schedule, _WEIGHT_PASS, (lists, found))
    return found
