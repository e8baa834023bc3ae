"""One sharding configuration ``plan`` weighs, and how it is applied to an unsharded model.

The knobs are those FSDP users turn by hand, one OOM at a time: how fine the ``fully_shard``
groups are, which units' activations are recomputed in backward (``torch.utils.checkpoint``),
which groups keep their parameters gathered from forward to backward, and whether sharded state
lives on the CPU. Each is a count over the units, so a configuration is four small values and
prints as one row of the plan's table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from ... import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from .structure import Units, children_with_parameters, has_own_parameters

ROOT, UNITS, CHILDREN = "root", "units", "children"  # the groupings, coarse to fine


@dataclass(frozen=True, order=True)
class Config:
    """``fully_shard`` per unit (``grouping="units"``), per child of each unit (``"children"``) or on
    the root alone (``"root"``); activation checkpointing on the first ``checkpointed`` units (they
    hold their activations longest); ``reshard_after_forward=False`` on the last ``kept`` units
    (backward needs them first); sharded parameters, gradients and optimizer state on the CPU
    (``offload``)."""

    grouping: str = UNITS
    checkpointed: int = 0
    kept: int = 0
    offload: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, units: Units) -> str:
        n = len(units.names)
        what = {ROOT: "one group (the root)", UNITS: "a group per unit", CHILDREN: "a group per unit's child"}
        parts = [what[self.grouping]]
        if n:
            parts.append(f"checkpointing {self.checkpointed} of {n} units")
            if self.grouping != ROOT:
                parts.append(f"{self.kept} of {n} kept unsharded after forward")
        parts.append("CPU offload" if self.offload else "no offload")
        return ", ".join(parts)


class Checkpointed:
    """A module's forward recomputed in backward (non-reentrant ``torch.utils.checkpoint``).

    Set as the instance's ``forward``, inside ``fully_shard``'s hooks: the group is gathered by its
    pre-forward hook and again by its pre-backward hook before the recompute, as torch's
    ``checkpoint_wrapper`` composes with FSDP2, without renaming any parameter. ``enabled`` lets the
    planner's calibration measure one model both ways."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.enabled = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def apply_config(
    model: nn.Module,
    units: Units,
    config: Config,
    mp_policy: MixedPrecisionPolicy,
    checkpoint_all: bool = False,
) -> list[Checkpointed]:
    """Shard ``model`` as ``config`` says; return the checkpointed forwards (every unit's with
    ``checkpoint_all``, the first ``config.checkpointed`` enabled)."""
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            f"plan: the model is already sharded (fully_shard was called on {sharded[0] or 'the root'}); "
            "build() must return the model unsharded, and Plan.apply shards it"
        )
    offload: OffloadPolicy = CPUOffloadPolicy() if config.offload else OffloadPolicy()
    switches = []
    n = len(units.names)
    for index, name in enumerate(units.names):
        unit = model.get_submodule(name)
        if checkpoint_all or index < config.checkpointed:
            switch = Checkpointed(unit.forward)
            switch.enabled = index < config.checkpointed
            unit.forward = switch
            switches.append(switch)
        if config.grouping == ROOT:
            continue
        reshard = index < n - config.kept
        kwargs = dict(reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
        if config.grouping == CHILDREN:
            for child in children_with_parameters(unit):
                fully_shard(child, **kwargs)
            if has_own_parameters(unit) or not children_with_parameters(unit):
                fully_shard(unit, **kwargs)
        else:
            fully_shard(unit, **kwargs)
    fully_shard(model, mp_policy=mp_policy, offload_policy=offload)
    return switches
