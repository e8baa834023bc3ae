"""torch.distributed.pipelining's schedules on our sharded stages: gradients reduced once per step.

A schedule runs every micro-batch's backward without gradient sync and reduces at the step's end
(``perform_reduce_grad``), but only for modules it recognizes as torch's ``FSDPModule``, whose
private state it then reads. ``install`` makes it recognize ours too, through our public setters,
and gives its step end ours: sync back on, the gradients held since the first micro-batch reduced
once, the parameters resharded. ``fully_shard`` and the setters the schedule calls run it once the
program has imported torch's pipelining: fsdp_compose never imports it (it imports torch's FSDP).
"""

from __future__ import annotations

import sys

from torch import nn

from .module import FSDPModule
from .runtime.hooks.backward import end_of_backward
from .runtime.state import state_of

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
