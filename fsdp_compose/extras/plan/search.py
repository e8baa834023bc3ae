"""The candidates ``plan`` weighs, priced from a few fake steps by arithmetic, and the choice.

Units being alike, a step with every unit checkpointed and one with none (for each grouping) price
any number in between: the peak moves linearly from one to the other (each checkpointed unit trades its saved
activations for its input), and the recompute is that many units' forward FLOPs. A unit kept
unsharded after forward adds its gathered parameters to the peak (counted as live for the whole
step: an upper bound) and saves its backward all-gather. CPU offload takes the sharded
parameters, their gradients and the optimizer state off the device (the measured peak without
them) and copies shards over the host link instead. Prices are only a ranking; the chosen
configuration is then measured by a fake step of its own, and one measured over the budget is
rejected for the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import CHILDREN, ROOT, UNITS, Config
from .measure import Measured

FITS, OVER, COSTLIER, CHOSEN = "fits", "over budget", "costs more", "chosen"


@dataclass(frozen=True)
class Rates:
    """What a byte and a FLOP cost, to rank bytes moved against recompute (defaults: one H100-class GPU
    per rank with InfiniBand between nodes)."""

    link_bytes_per_s: float = 50e9  # collectives, per rank
    host_bytes_per_s: float = 25e9  # CPU offload's copies (PCIe)
    flops_per_s: float = 400e12  # achieved, in the compute dtype


@dataclass
class Calibration:
    """The fake steps' figures the candidates are priced from."""

    units: int
    plain: dict[str, Measured]  # grouping -> a step with nothing checkpointed or kept
    checkpointed: dict[str, Measured]  # grouping -> every unit checkpointed, nothing kept (none without units)
    groups: dict[str, int]  # grouping -> fully_shard calls
    unsharded_bytes: list[int]  # per unit, gathered (in the gather dtype)
    gather_bytes: list[int]  # per unit, one all-gather of its groups
    sharded_bytes: int  # this rank's shards of every parameter


@dataclass
class Candidate:
    config: Config
    groups: int
    peak_bytes: int  # predicted
    moved_bytes: int  # collectives per step
    host_bytes: int  # CPU offload's copies per step
    recompute_flops: int
    cost_seconds: float
    verdict: str = FITS
    measured_bytes: int | None = None  # the fake step's, for a candidate measured on its own

    def to_dict(self) -> dict:
        return {**self.__dict__, "config": self.config.to_dict()}

    @staticmethod
    def from_dict(data: dict) -> Candidate:
        return Candidate(**{**data, "config": Config(**data["config"])})


def _spread(n: int) -> list[int]:
    return sorted({0, math.ceil(n / 4), math.ceil(n / 2), math.ceil(3 * n / 4), n})


def groupings(units: int, repeated: bool, splittable: bool) -> list[str]:
    """Coarse to fine: each repeated block or its children; else the root alone or its children."""
    if repeated:
        return [UNITS, CHILDREN] if splittable else [UNITS]
    return [ROOT, UNITS] if units else [ROOT]


def configurations(units: int, grouping_options: list[str], accelerator: bool) -> list[Config]:
    out = []
    for grouping in grouping_options:
        for checkpointed in _spread(units):
            for kept in sorted({0, 1, units}) if grouping != ROOT and units else [0]:
                for offload in (False, True) if accelerator else (False,):
                    out.append(Config(grouping, checkpointed, kept, offload))
    return out


def price(cal: Calibration, config: Config, rates: Rates) -> Candidate:
    base = cal.plain[config.grouping]
    peak = base.peak(config.offload)
    recompute = 0
    if config.checkpointed:
        share, every = config.checkpointed / cal.units, cal.checkpointed[config.grouping]
        peak += round(share * (every.peak(config.offload) - base.peak(config.offload)))
        recompute = round(share * max(every.flops - base.flops, 0))
    last = slice(cal.units - config.kept, cal.units) if config.kept else slice(0, 0)
    peak += sum(cal.unsharded_bytes[last])
    moved = base.moved_bytes - sum(cal.gather_bytes[last])
    host = 3 * cal.sharded_bytes if config.offload else 0  # each shard up for forward and backward, its gradient down
    cost = moved / rates.link_bytes_per_s + host / rates.host_bytes_per_s + recompute / rates.flops_per_s
    return Candidate(config, cal.groups[config.grouping], peak, moved, host, recompute, cost)


def rank(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """Those predicted to fit, cheapest first (ties to fewer groups); every candidate's verdict set."""
    for c in candidates:
        c.verdict = FITS if c.peak_bytes <= budget else OVER
    return sorted((c for c in candidates if c.verdict == FITS), key=order)


def order(c: Candidate) -> tuple:
    return (round(c.cost_seconds, 12), c.groups, c.config)
