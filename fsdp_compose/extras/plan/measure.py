"""A fake step as ``estimate`` measures it, plus what ``plan`` prices candidates by: the peak without the
state CPU offload moves off the device, and the step's floating-point operations.

The counting is ``fake_step.measured_step``'s (the same timeline, labels and peak), so the chosen
configuration's figure is the one ``estimate`` would report for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from ..observe.fake_step import GRADIENTS, OPTIMIZER_STATE, PARAMETERS, UNSHARDED_GRADIENTS, measured_step
from ..observe.timeline import CollectiveTimeline

BUFFERS = "buffers"  # stay on the device under CPU offload, unlike the sharded parameters they are counted with


class CountingTimeline(CollectiveTimeline):
    """``CollectiveTimeline`` that also sums the FLOPs of the operators it sees (torch's flop formulas)."""

    def __init__(self, hold_reduce_inputs: bool) -> None:
        super().__init__(hold_reduce_inputs, inherited=frozenset({UNSHARDED_GRADIENTS}))
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        formula = flop_registry.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.flops += int(formula(*args, **(kwargs or {}), out_val=out))
        return out


@dataclass(frozen=True)
class Measured:
    """One fake step's figures, per rank."""

    peak_bytes: int  # live tensor storages at the step's peak, as estimate reports it
    offloaded_peak_bytes: int  # the same without sharded parameters, their gradients and the optimizer state
    moved_bytes: int  # all-gather, reduce-scatter and all-reduce bytes, as CommStats counts them
    flops: int
    phase: str
    at_peak: dict[str, int] = field(default_factory=dict)

    def peak(self, offload: bool) -> int:
        return self.offloaded_peak_bytes if offload else self.peak_bytes


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, hold_reduce_inputs: bool) -> Measured:
    timeline = CountingTimeline(hold_reduce_inputs)
    result = measured_step(model, optimizer, loss_fn, hold_reduce_inputs, timeline=timeline)
    timeline.label(list(model.buffers()), BUFFERS)
    offloaded, _ = timeline.peak_without(PARAMETERS, GRADIENTS, OPTIMIZER_STATE)
    return Measured(
        peak_bytes=result["peak_bytes"],
        offloaded_peak_bytes=offloaded,
        moved_bytes=sum(nbytes for _, nbytes in result["collectives"].values()),
        flops=timeline.flops,
        phase=result["peak_phase"],
        at_peak=result["at_peak"],
    )
