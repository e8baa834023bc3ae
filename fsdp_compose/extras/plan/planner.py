"""``plan(build, world_size, budget)``: how should this model be sharded to fit in so many bytes per rank?

The answer is searched on fake tensors in a subprocess (``plan_step.py``), as ``estimate`` runs its
step, so every rank of a running job may call it and gets the same ``Plan``: the subprocess is
rank 0 of ``world_size`` and nothing in it depends on time or on the calling rank.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import MixedPrecisionPolicy
from ..observe.estimate import _ENV_DROPPED, _reference, _table
from ..observe.explain import fmt_bytes
from .config import Config, apply_config
from .search import CHOSEN, Candidate, Rates, order
from .structure import Units

logger = logging.getLogger(__name__)

_SCALE = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SCALE.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


class BudgetError(Exception):
    """No sharding configuration ``plan`` weighed fits the budget; the message names the smallest
    predicted peak, its configuration and the budget."""

    __module__ = "fsdp_compose"


def parse_budget(budget: int | str) -> int:
    """Bytes per rank from ``12 * 2**30``, ``"12GiB"``, ``"500 MiB"`` or ``"80GB"`` (powers of 1000)."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        nbytes = budget
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", budget)
        if match is None or match.group(2).lower() not in _SCALE:
            raise ValueError(f"plan: budget {budget!r}: a number of bytes or a string like '12GiB', '500MiB', '80GB'")
        nbytes = int(float(match.group(1)) * _SCALE[match.group(2).lower()])
    else:
        raise TypeError(f"plan: budget is {type(budget).__name__}: bytes as an int, or a string like '12GiB'")
    if nbytes <= 0:
        raise ValueError(f"plan: budget {budget!r} is not a positive number of bytes")
    return nbytes


def _flops(n: int) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} FLOP"


@dataclass
class Plan:
    """What ``plan`` chose and what it weighed; ``apply(model)`` shards a model as chosen.

    Bytes are per rank (rank 0, which holds the largest shards when sizes do not divide)."""

    world_size: int
    budget_bytes: int
    units: Units
    config: Config
    peak_bytes: int  # the chosen configuration's own fake step, as estimate() reports it
    predicted_peak_bytes: int  # what the search predicted for it
    candidates: list[Candidate] = field(default_factory=list)
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    device: str = "cpu"
    rates: Rates = field(default_factory=Rates)
    fake_steps: int = 0
    seconds: float = 0.0

    def apply(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` (built as ``build`` builds it, unsharded: real or on ``meta``) as chosen:
        ``fully_shard`` per group with its ``reshard_after_forward``, the chosen units' forwards
        checkpointed, CPU offload if chosen. Build the optimizer afterwards. Returns ``model``."""
        missing = [name for name in self.units.names if _submodule(model, name) is None]
        if missing:
            raise ValueError(
                f"Plan.apply: the model has no submodule {missing[0]!r}; the plan was made for a model with "
                f"{self.units.describe()}: build this model as build() does"
            )
        apply_config(model, self.units, self.config, self.mp_policy)
        return model

    def summary(self) -> str:
        return "\n".join(
            [
                f"plan for world size {self.world_size}, budget {fmt_bytes(self.budget_bytes)} per rank, "
                f"on {self.device}; units: {self.units.describe()}",
                f"chosen: {self.config.describe(self.units)}",
                f"peak {fmt_bytes(self.peak_bytes)} per rank in its own fake step (predicted "
                f"{fmt_bytes(self.predicted_peak_bytes)}); {self.fake_steps} fake steps",
            ]
        )

    def table(self, rows: int | None = None) -> str:
        """Every configuration weighed, or the ``rows`` cheapest before and after the chosen one."""
        if rows is None:
            return table(self.candidates)
        chosen = next(c for c in self.candidates if c.verdict == CHOSEN)
        return table(self.candidates, chosen, rows)

    def __str__(self) -> str:
        return "\n".join([self.summary(), "", self.table(), legend(self.rates)])


def table(candidates: list[Candidate], around: Candidate | None = None, rows: int = 0) -> str:
    """The configurations weighed, cheapest first: predicted peak, traffic, recompute and verdict. With
    ``around``, only the ``rows`` cheapest before it and after it, and a line saying how many are left out."""
    ordered = sorted(candidates, key=order)
    before = after = 0
    if around is not None:
        at = ordered.index(around)
        before, after = max(at - rows, 0), max(len(ordered) - at - 1 - rows, 0)
        ordered = ordered[before : len(ordered) - after]
    lines = [("grouping", "groups", "checkpointed", "kept", "offload", "predicted peak", "fake step",
              "moved / step", "recompute", "cost", "verdict")]
    for c in ordered:
        lines.append((
            c.config.grouping,
            str(c.groups),
            str(c.config.checkpointed),
            str(c.config.kept),
            "yes" if c.config.offload else "no",
            fmt_bytes(c.peak_bytes),
            fmt_bytes(c.measured_bytes),
            fmt_bytes(c.moved_bytes + c.host_bytes),
            _flops(c.recompute_flops),
            f"{c.cost_seconds * 1e3:.2f} ms",
            c.verdict,
        ))
    text = _table(lines)
    if before:
        text += f"\n({before} cheaper configurations left out, all over the budget)"
    if after:
        text += f"\n({after} costlier configurations left out)"
    return text


def legend(rates: Rates) -> str:
    return (
        "checkpointed: the first units' forward recomputed in backward; kept: the last units with "
        "reshard_after_forward=False;\n"
        f"cost: bytes moved at {rates.link_bytes_per_s / 1e9:g} GB/s (CPU offload's copies at "
        f"{rates.host_bytes_per_s / 1e9:g} GB/s) plus recompute at {rates.flops_per_s / 1e12:g} TFLOP/s"
    )


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def plan(
    build: Callable[[], tuple[nn.Module, Callable[..., torch.optim.Optimizer], Callable[[], torch.Tensor]]],
    world_size: int,
    budget: int | str,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    device: str | None = None,
    like: str = "nccl",
    rates: Rates | None = None,
    timeout: float = 600.0,
) -> Plan:
    """Choose how to shard ``build``'s model so one training step fits in ``budget`` bytes per rank.

    ``build()`` returns ``(model, optimizer_fn, loss_fn)`` as for ``estimate``, but with the model
    **not** sharded (build a large one on the ``meta`` device), ``optimizer_fn`` a function of the
    parameters making the optimizer, and ``loss_fn()`` one batch's loss. It runs in a subprocess
    on fake tensors at ``world_size`` (a module-level function, as for ``estimate``).

    Weighed: a ``fully_shard`` group per repeated block (the largest run of same-class children
    of a ``ModuleList`` / ``Sequential``) or per child of each block; activation checkpointing on
    0, a quarter, half, three quarters or all of the blocks; ``reshard_after_forward=False`` on
    none, the last, or every block; CPU offload of parameters and optimizer state where
    ``device`` is an accelerator (default: this machine's, else ``"cpu"``). A model without
    repeated blocks has the root's children instead, or the root alone. Three fake steps per
    grouping (every block checkpointed, twice, then none) price every candidate; among those predicted to fit, the least step cost wins (bytes moved
    over ``rates``' link and host bandwidths plus recompute FLOPs over its FLOP rate; ties to
    fewer groups), and its own fake step gives ``Plan.peak_bytes`` (if that is over the budget,
    the next is tried). ``mp_policy`` is yours and kept (plan never changes numerics); ``like``
    as for ``estimate``. ``budget``: bytes, or a string like ``"12GiB"`` / ``"500MiB"``.

    Raises ``BudgetError`` when nothing fits, naming the smallest predicted peak and its
    configuration; ``TypeError`` / ``ValueError`` / ``RuntimeError`` when ``build`` returns the
    wrong things, shards the model itself, or raises. ``str(plan)`` is the table of every
    configuration weighed; ``plan.apply(model)`` shards a model built the same way.
    """
    nbytes = parse_budget(budget)
    if like not in ("nccl", "gloo"):
        raise ValueError(f"plan(like={like!r}): 'nccl' or 'gloo'")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    rates = rates or Rates()
    if device is None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = accelerator.type if accelerator is not None else "cpu"
    sys_path = [os.path.abspath(p or os.curdir) for p in sys.path]
    spec = {
        "world_size": world_size,
        "budget": nbytes,
        "accelerator": device != "cpu",
        "like": like,
        "mp_policy": base64.b64encode(pickle.dumps(mp_policy)).decode(),  # dtypes and flags: plain pickle
        "rates": dataclasses.asdict(rates),
        "sys_path": sys_path,
        **_reference(build),
    }
    result = _run_subprocess(spec, sys_path, timeout)
    if "error" in result:
        kind = {"TypeError": TypeError, "ValueError": ValueError}.get(result["error"]["kind"], RuntimeError)
        raise kind(result["error"]["message"])
    units = Units(tuple(result["units"]["names"]), result["units"]["repeated"], result["units"]["kind"])
    candidates = [Candidate.from_dict(c) for c in result["candidates"]]
    if result["chosen"] is None:
        smallest = min(candidates, key=lambda c: (c.peak_bytes, order(c)))
        raise BudgetError(
            f"plan: no configuration fits {fmt_bytes(nbytes)} per rank ({nbytes} bytes) at world size {world_size}: "
            f"the smallest predicted peak is {fmt_bytes(smallest.peak_bytes)}, with {smallest.config.describe(units)}. "
            f"Units: {units.describe()}. Configurations weighed:\n{table(candidates)}\n{legend(rates)}"
        )
    chosen = candidates[result["chosen"]]
    assert chosen.verdict == CHOSEN and chosen.measured_bytes is not None
    return Plan(world_size, nbytes, units, chosen.config, chosen.measured_bytes, chosen.peak_bytes, candidates,
                mp_policy, device, rates, result["fake_steps"], result["seconds"])


def _run_subprocess(spec: dict[str, Any], sys_path: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fsdp_compose_plan_") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED and not k.startswith("TORCHELASTIC")}
        env.update(RANK="0", WORLD_SIZE=str(spec["world_size"]), PYTHONPATH=os.pathsep.join(sys_path))
        began = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "fsdp_compose.extras.plan.plan_step", spec_path, out_path],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as error:
            raise TimeoutError(f"plan: the fake steps did not finish in {timeout:.0f} s (killed)") from error
        if done.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"plan: the fake steps failed (exit code {done.returncode}):\n{done.stdout[-4000:]}")
        with open(out_path) as f:
            result = json.load(f)
    logger.info("plan: world size %d, %.1f s with the subprocess's start", spec["world_size"], time.perf_counter() - began)
    return result
