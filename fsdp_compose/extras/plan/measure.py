"""A fake step as ``estimate`` measures it, plus what ``plan`` prices candidates by: the peak without the
state CPU offload moves off the device, and the step's floating-point operations.

The counting is ``fake_step.measured_step``'s (the same timeline, labels and peak), so the chosen
configuration's figure is the one ``estimate`` would report for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from ..observe.fake_step import GRADIENTS, OPTIMIZER_STATE, PARAMETERS, UNSHARDED_GRADIENTS, measured_step
from ..observe.timeline import CollectiveTimeline

BUFFERS = "buffers"  # stay on the device under CPU offload, unlike the sharded parameters they are counted with


class CountingTimeline(CollectiveTimeline):
    """``CollectiveTimeline`` that also sums the FLOPs of the operators it sees (torch's flop formulas)."""

    def __init__(self, like: str) -> None:
        super().__init__(like, inherited=frozenset({UNSHARDED_GRADIENTS}))
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


def highest(first: Measured, then: Measured) -> Measured:
    """Two steps of one configuration as ``estimate`` reports them: the higher peak, the later step's traffic."""
    top = first if first.peak_bytes > then.peak_bytes else then
    return replace(
        then,
        peak_bytes=top.peak_bytes,
        phase=top.phase,
        at_peak=top.at_peak,
        offloaded_peak_bytes=max(first.offloaded_peak_bytes, then.offloaded_peak_bytes),
    )


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, like: str, earlier: dict) -> Measured:
    """One step; ``earlier``: the tensors alive before the job was built, as ``measured_step`` takes them."""
    timeline = CountingTimeline(like)
    result = measured_step(model, optimizer, loss_fn, like, earlier, timeline=timeline)
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
