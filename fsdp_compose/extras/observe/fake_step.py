"""The subprocess behind ``estimate``: one training step on fake tensors at the target world size.

Run as ``python -m fsdp_compose.extras.observe.fake_step SPEC OUT`` (``SPEC``: a JSON file naming the
build function or holding it pickled; ``OUT``: where the JSON result goes; stdout is the user's).
Torch's fake process group stands in for the ranks (rank ``rank`` of ``world_size``; every
collective returns at once, moving nothing) and ``FakeTensorMode`` for the memory: tensors have
shapes, dtypes and storages but no data, so a 70B-parameter step costs only Python time.
"""

from __future__ import annotations

import base64
import gc
import importlib
import json
import pickle
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...extras_api import group_facts, groups_in, unsharded_parameters
from .explain import explain
from .timeline import UNLABELLED, CollectiveTimeline

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
UNSHARDED_PARAMETERS = "unsharded parameters"
UNSHARDED_GRADIENTS = "unsharded gradients"


def load_build(spec: dict) -> Callable[[], Any]:
    if "pickled" in spec:
        return pickle.loads(base64.b64decode(spec["pickled"]))
    target: Any = importlib.import_module(spec["module"])
    for part in spec["qualname"].split("."):
        target = getattr(target, part)
    return target


def unpack(built: Any) -> tuple[nn.Module, Any, Callable[[], torch.Tensor]]:
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module) and callable(built[2])):
        raise TypeError(
            "estimate: build() must return (model, optimizer, loss_fn): the sharded nn.Module, a torch "
            "optimizer or a function of the parameters making one, and a function of no arguments returning "
            f"one batch's loss; got {type(built).__name__}"
        )
    return built


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def traffic(model: nn.Module) -> dict[str, list[int]]:
    """Calls and bytes so far per collective kind, summed over the model's groups."""
    out = {"all-gather": [0, 0], "reduce-scatter": [0, 0], "all-reduce": [0, 0]}
    for _, handle in groups_in(model):
        for kind, (calls, nbytes) in group_facts(handle).traffic.items():
            out[kind][0] += calls
            out[kind][1] += nbytes
    return out


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, timeline: CollectiveTimeline | None) -> None:
    def phase(name: str) -> None:
        if timeline is not None:
            timeline.enter_phase(name)

    phase("forward")
    loss = loss_fn()
    phase("backward")
    loss.backward()
    del loss
    if timeline is not None:  # the sharded gradients, now that they exist
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        timeline.label(grads, GRADIENTS)
    phase("optimizer step")
    optimizer.step()
    if timeline is not None:
        timeline.label(_optimizer_tensors(optimizer), OPTIMIZER_STATE)
    optimizer.zero_grad()


def _phase_of(timeline: CollectiveTimeline, event: int) -> str:
    """The phase an event belongs to: the last phase whose first event is not after it."""
    found = "-"
    for phase, first in timeline.phase_starts:
        if first <= event:
            found = phase
    return found


def measured_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    like: str | None,
    earlier: dict | None = None,
    timeline: CollectiveTimeline | None = None,
) -> dict:
    """One step under a ``CollectiveTimeline``: the peak, its bytes by category, the traffic.

    Counted from the start: every tensor alive but ``earlier`` ones (weak references by ``id``, taken before
    the job was built): the model's, the optimizer's, and what the runtime keeps between steps (padding rows,
    has-gradient flags, slices kept after forward), found by the garbage collector. ``timeline``: a fresh one
    to count with, for a caller that reads more of it afterwards (``plan``)."""
    if timeline is None:
        timeline = CollectiveTimeline(like, inherited=frozenset({UNSHARDED_GRADIENTS}))
    timeline.label(list(model.parameters()) + list(model.buffers()), PARAMETERS)
    timeline.label(_optimizer_tensors(optimizer), OPTIMIZER_STATE)
    handles = []
    for _, group in groups_in(model):
        for unsharded in unsharded_parameters(group):
            timeline.label([unsharded], UNSHARDED_PARAMETERS)
            if unsharded.requires_grad:  # a pre-hook: sees the gradient before the runtime reduces it
                handles.append(unsharded.register_hook(lambda g: timeline.label([g], UNSHARDED_GRADIENTS)))
    earlier = earlier or {}
    timeline.track(t for key, t in _tensors_now().items() if key not in earlier or earlier[key]() is not t)
    before = traffic(model)
    try:
        with timeline, _beyond_operators(timeline):
            _step(model, optimizer, loss_fn, timeline)
    finally:
        for h in handles:
            h.remove()
    after = traffic(model)
    for _, group in groups_in(model):  # a first step makes them
        timeline.label(unsharded_parameters(group), UNSHARDED_PARAMETERS, override=False)
    without, event = timeline.peak_without(UNLABELLED)
    return {
        "peak_without_activations": without,
        "phase_without_activations": _phase_of(timeline, event),
        "peak_bytes": timeline.peak,
        "settled_peak_bytes": timeline.settled_peak,
        "peak_phase": _phase_of(timeline, timeline.peak_event),
        "at_peak": timeline.live_at(timeline.peak_event),
        "phase_peaks": {p: b for p, (b, _) in timeline.phase_peaks.items() if p != "-"},
        "collectives": {k: [after[k][0] - before[k][0], after[k][1] - before[k][1]] for k in after},
    }


def _tensors_now() -> dict[int, torch.Tensor]:
    """Every tensor object alive in this process, by ``id`` (but those ``earlier_tensors_set_aside`` froze)."""
    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@contextmanager
def earlier_tensors_set_aside():
    """Weak references, by ``id``, to the tensors alive before a job is built (earlier jobs' leftovers), none
    of which the job's steps count; for the block, every object alive now is set aside from collections
    (``gc.freeze``, undone after): ``_tensors_now`` collects before each fake step, and a collection that walks
    what torch's imports made (over 200,000 objects) takes about 0.1 s, much less without it. An object set
    aside is no tensor of the job either way."""
    earlier = {key: weakref.ref(t) for key, t in _tensors_now().items()}
    gc.freeze()
    try:
        yield earlier
    finally:
        gc.unfreeze()


def _highest(steps: list[dict]) -> dict:
    """The last step's figures, with the peak (its bytes, phase and composition) of the step that peaks highest."""
    result = dict(steps[-1])
    top = max(steps, key=lambda step: step["peak_bytes"])
    result.update({key: top[key] for key in ("peak_bytes", "peak_phase", "at_peak")})
    result["settled_peak_bytes"] = max(step["settled_peak_bytes"] for step in steps)
    if top is not steps[-1]:
        result["peak_phase"] = f"first step's {top['peak_phase']}"
    result["phase_peaks"] = {
        phase: max(step["phase_peaks"].get(phase, 0) for step in steps) for phase in steps[-1]["phase_peaks"]
    }
    return result


# the process group's single-tensor collectives, as torch 2.13 and earlier versions name them
_COLLECTIVE_METHODS = (
    "all_gather_single",
    "_allgather_base",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "allreduce",  # the order check's handshakes
)


class _Waited:
    """A collective's work that tells the timeline when it is waited on (the fake one is done at once)."""

    __slots__ = ("work", "output", "group", "timeline")

    def __init__(self, work, output: torch.Tensor, group: object, timeline: CollectiveTimeline) -> None:
        self.work, self.output, self.group, self.timeline = work, output, group, timeline
        timeline.issued(group, output)

    def wait(self, timeout=None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.timeline.waited(self.output, self.group)
        return done


@contextmanager
def _beyond_operators(timeline: CollectiveTimeline):
    """While it is entered, the process group's collectives return works whose ``wait`` reaches ``timeline``
    (what a backend holds during a collective is let go at its wait, not at the output's next use), and the
    CPU random state ``torch.get_rng_state()`` copies, which no operator makes, is counted."""
    cls = dist.ProcessGroup
    originals = {name: cls.__dict__[name] for name in _COLLECTIVE_METHODS if name in cls.__dict__}  # as stored

    def wrap(original):
        def issue(group, output, *args, **kwargs):
            work = original.__get__(group)(output, *args, **kwargs)
            return _Waited(work, output[0] if isinstance(output, (list, tuple)) else output, group, timeline)

        return issue

    for name, original in originals.items():
        setattr(cls, name, wrap(original))
    get_rng_state = torch.get_rng_state

    def rng_state() -> torch.Tensor:  # made without an operator: activation checkpointing keeps one per call
        state = get_rng_state()
        timeline.track([state])
        return state

    torch.get_rng_state = rng_state
    try:
        yield
    finally:
        torch.get_rng_state = get_rng_state
        for name, original in originals.items():
            setattr(cls, name, original)


@contextmanager
def backend_paths(like: str):
    """On the fake process group, the runtime takes ``like``'s paths: for "gloo", the reduce-scatters that wait
    for the next handshake (the backend name is what the runtime reads to choose them)."""
    get_backend = dist.get_backend
    if like == "gloo":
        dist.get_backend = lambda group=None: "gloo" if get_backend(group) == "fake" else get_backend(group)
    try:
        yield
    finally:
        dist.get_backend = get_backend


def _fake_mode_of(model: nn.Module):
    """The ``FakeTensorMode`` the model's parameters were made in, if they are FakeTensors."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        mode = getattr(local, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def run(spec: dict) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    world, rank = spec["world_size"], spec["rank"]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with backend_paths(spec["like"]):
            return _measured_job(spec, world, rank)
    finally:
        dist.destroy_process_group()


def _measured_job(spec: dict, world: int, rank: int) -> dict:
    """The job's build, warm-up steps and measured step, under the fake process group ``run`` set up."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with earlier_tensors_set_aside() as earlier:  # earlier jobs' leftovers
        started = time.perf_counter()
        model, optimizer, loss_fn = unpack(load_build(spec)())
        built = time.perf_counter()
        # a model built under FakeTensorMode (as torchtitan's estimator builds) steps in that mode
        with _fake_mode_of(model) or FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")  # meta or real parameters become fake ones; values do not matter
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = optimizer(model.parameters())
            # the first step records the order and makes the optimizer state; it is measured too
            like = spec["like"]
            steps = [measured_step(model, optimizer, loss_fn, like, earlier) for _ in range(spec["warmup_steps"])]
            plan = explain(model, optimizer)
            result = _highest([*steps, measured_step(model, optimizer, loss_fn, like, earlier)])
    result.update(
        world_size=world,
        rank=rank,
        plan=str(plan),
        predicted_peak_bytes=plan.totals.predicted_peak_bytes,
        build_seconds=round(built - started, 2),
        step_seconds=round((time.perf_counter() - built) / (spec["warmup_steps"] + 1), 2),
        seconds=round(time.perf_counter() - started, 2),
    )
    return result


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]
    results = [run(job) for job in spec["jobs"]]  # each with its own process group, model and fake mode
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
