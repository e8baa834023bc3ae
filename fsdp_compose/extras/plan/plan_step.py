"""The subprocess behind ``plan``: the calibrating fake steps, the search, the chosen configuration's step.

Run as ``python -m fsdp_compose.extras.plan.plan_step SPEC OUT``, like ``estimate``'s fake step (rank 0
of ``world_size`` on torch's fake process group and fake tensors: rank 0 holds the largest shards).
Everything happens in this one process, so an interpreter starts once: each grouping is built
once and measured with every unit checkpointed and with none,
the candidates are priced (``search.py``) and the cheapest predicted to fit gets a fake step of
its own, built and sharded exactly as ``Plan.apply`` will. A ``build`` that fails or returns the
wrong things is reported as data (``{"error": ...}``), for ``plan`` to raise in the caller.
"""

from __future__ import annotations

import base64
import json
import pickle
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ... import FSDPModule, MixedPrecisionPolicy
from ...extras_api import group_facts, group_of, groups_in
from ..observe.fake_step import _fake_mode_of, _step, backend_paths, earlier_tensors_set_aside, load_build
from .config import UNITS, Config, apply_config
from .measure import Measured, highest, measure
from .search import CHOSEN, COSTLIER, FITS, Calibration, Rates, configurations, groupings, price, rank
from .structure import Units, children_with_parameters, find_units

MAX_TRIES = 3  # candidates measured before giving up on the prediction
RETURNS = (
    "build() must return (model, optimizer_fn, loss_fn): the model NOT sharded (plan shards it), a function "
    "of the parameters making the optimizer, and a function of no arguments returning one batch's loss"
)


class _BadBuild(Exception):
    """``build`` raised or returned the wrong things; ``kind`` is the exception ``plan`` raises."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def call_build(build: Callable[[], Any]) -> tuple[nn.Module, Callable, Callable[[], torch.Tensor]]:
    try:
        built = build()
    except Exception as error:  # noqa: BLE001 - reported to the caller with what build must do
        raise _BadBuild("RuntimeError", f"plan: build() raised {type(error).__name__}: {error}\n{RETURNS}") from error
    if not (isinstance(built, tuple) and len(built) == 3):
        raise _BadBuild("TypeError", f"plan: build() returned {type(built).__name__}, not a 3-tuple; {RETURNS}")
    model, make_optimizer, loss_fn = built
    if not isinstance(model, nn.Module):
        raise _BadBuild("TypeError", f"plan: build()'s first item is {type(model).__name__}, not an nn.Module; {RETURNS}")
    if isinstance(make_optimizer, torch.optim.Optimizer) or not callable(make_optimizer):
        raise _BadBuild(
            "TypeError",
            f"plan: build()'s second item is {type(make_optimizer).__name__}; plan shards the model, which replaces "
            f"its parameters, so it needs a function of the parameters making the optimizer; {RETURNS}",
        )
    if not callable(loss_fn):
        raise _BadBuild("TypeError", f"plan: build()'s third item is {type(loss_fn).__name__}, not callable; {RETURNS}")
    sharded = [name or "the root" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise _BadBuild("ValueError", f"plan: build() sharded the model itself (fully_shard on {sharded[0]}); {RETURNS}")
    return model, make_optimizer, loss_fn


def _unsharded_bytes(module: nn.Module, mp_policy: MixedPrecisionPolicy) -> int:
    return sum(p.numel() * (mp_policy.param_dtype or p.dtype).itemsize for p in module.parameters())


def fake_steps(build, units: Units, config: Config, mp_policy, like: str, checkpoint_all: bool = False):
    """Build, shard as ``config`` says, materialize on fake tensors and run two steps. Without
    ``checkpoint_all`` both are measured, as ``estimate`` measures (its figure: the higher); with it (the
    calibration) every unit is checkpointed in those two, only the second measured, and a third step is
    measured with none.

    Returns the measurements (checkpointed, then plain), the model's group count, each unit's all-gather
    bytes per call and this rank's shard bytes."""
    with earlier_tensors_set_aside() as earlier:  # the previous builds' leftovers
        model, make_optimizer, loss_fn = call_build(build)
        switches = apply_config(model, units, config, mp_policy, checkpoint_all)
        with _fake_mode_of(model) or FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = make_optimizer(model.parameters())
            if checkpoint_all:  # the first step records the order and makes the optimizer state
                _step(model, optimizer, loss_fn, None)
                measured = [measure(model, optimizer, loss_fn, like, earlier)]
            else:
                first = measure(model, optimizer, loss_fn, like, earlier)
                measured = [highest(first, measure(model, optimizer, loss_fn, like, earlier))]
            if checkpoint_all:
                for switch in switches:
                    switch.enabled = False
                measured.append(measure(model, optimizer, loss_fn, like, earlier))
    gather = []
    for name in units.names:
        handle = group_of(model.get_submodule(name))
        calls, nbytes = group_facts(handle).traffic["all-gather"] if handle is not None else (0, 0)
        gather.append(nbytes // max(calls, 1))
    handles = groups_in(model)
    sharded = sum(p.local_bytes for _, h in handles for p in group_facts(h).params)
    return measured, len(handles), gather, sharded


def search(spec: dict) -> dict:
    build = load_build(spec)
    mp_policy = pickle.loads(base64.b64decode(spec["mp_policy"]))
    like, budget, rates = spec["like"], spec["budget"], Rates(**spec["rates"])
    model = call_build(build)[0]
    units = find_units(model)
    n = len(units.names)
    unsharded = [_unsharded_bytes(model.get_submodule(name), mp_policy) for name in units.names]
    splittable = any(len(children_with_parameters(model.get_submodule(name))) > 1 for name in units.names)
    del model
    options = groupings(n, units.repeated, splittable)
    plain: dict[str, Measured] = {}
    checkpointed: dict[str, Measured] = {}
    groups: dict[str, int] = {}
    gather, sharded, steps = [0] * n, 0, 0
    for grouping in options:
        measured, groups[grouping], unit_gather, sharded = fake_steps(
            build, units, Config(grouping, checkpointed=n), mp_policy, like, checkpoint_all=n > 0
        )
        steps += 3 if n else 2
        if grouping == UNITS:
            gather = unit_gather
        checkpointed[grouping], plain[grouping] = measured[0], measured[-1]
    cal = Calibration(n, plain, checkpointed, groups, unsharded, gather, sharded)
    candidates = [price(cal, config, rates) for config in configurations(n, options, spec["accelerator"])]
    chosen = None
    for candidate in rank(candidates, budget)[:MAX_TRIES]:
        measured, *_ = fake_steps(build, units, candidate.config, mp_policy, like)
        steps += 2
        candidate.measured_bytes = measured[0].peak(candidate.config.offload)
        if candidate.measured_bytes <= budget:
            candidate.verdict, chosen = CHOSEN, candidate
            break
        candidate.verdict = "over budget in its fake step"
    for candidate in candidates:
        if candidate.verdict == FITS:
            candidate.verdict = COSTLIER if chosen is not None else "not measured"
    return {
        "units": {"names": list(units.names), "repeated": units.repeated, "kind": units.kind},
        "candidates": [c.to_dict() for c in candidates],
        "chosen": None if chosen is None else candidates.index(chosen),
        "fake_steps": steps,
    }


def run(spec: dict) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec["world_size"])
    started = time.perf_counter()
    try:
        with backend_paths(spec["like"]):  # the runtime takes gloo's paths, as in estimate's fake step
            result = search(spec)
    except _BadBuild as error:
        result = {"error": {"kind": error.kind, "message": str(error)}}
    finally:
        dist.destroy_process_group()
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
