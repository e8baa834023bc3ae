"""torch.distributed.pipelining's schedules on our sharded stages: gradients reduced once per step.

A schedule runs every micro-batch's backward without gradient sync and reduces at the step's end
(``perform_reduce_grad``), but only for modules it recognizes as torch's ``FSDPModule``, whose
private state it then reads. ``install`` makes it recognize ours too, through our public setters,
and gives its step end ours: sync back on, the gradients held since the first micro-batch reduced
once, the parameters resharded. ``fully_shard`` runs it when the program has imported torch's
pipelining: fsdp_compose never imports it (it imports torch's FSDP). It also refuses zero-bubble
schedules on stages that reshard after forward, whose weight gradients would be lost.
"""

from __future__ import annotations

import sys

from torch import nn

from .module import FSDPModule
from .runtime.hooks.backward import end_of_backward
from .runtime.schedule import reshards_after_forward
from .runtime.state import state_of, states_in

STAGE, SCHEDULES = "torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules"
_OURS = "_fsdp_compose_step_end"


def install() -> None:
    """Teach an imported ``torch.distributed.pipelining`` our modules (idempotent; torch's still work)."""
    stage = sys.modules.get(STAGE)
    if stage is None:
        return
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
    order = getattr(schedule, "pipeline_order", None) or {}
    if not any(  # the schedule has a weight pass
        action is not None and getattr(action.computation_type, "name", "") == "BACKWARD_WEIGHT"
        for actions in order.values()
        for action in actions
    ):
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
