"""What a load leaves without values, initialized the way the model initializes it.

A model built on ``meta`` gets storage from ``load_pretrained`` (``to_empty``): whatever the checkpoint does not
hold would keep that memory's garbage (``strict=False``'s missing names, a peft model's adapters). Each module
owning such a tensor runs its own initialisation instead: a Hugging Face model's ``_init_weights(module)``, a
given ``init_missing(module)``, or ``module.reset_parameters()``; peft's adapters, peft's own reset. As in
``init_sharded_parameters``, the module's sharded parameters are swapped for full-size tensors while it runs and
each rank keeps its rows (DTensor's random ops on a CPU mesh would draw the same rows on every rank), and every
rank draws from rank 0's random state, so the ranks hold one initialisation; the caller's random state is left
as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...extras_api import group_facts, groups_in, write_full

Slot = tuple[nn.Module, str]  # a parameter by where it is registered: to_empty replaces the tensor objects
ModuleInit = Callable[[nn.Module], None]


@dataclasses.dataclass
class InitJob:
    """One initialisation: ``run()`` with ``slots`` held at full size; ``names`` says what it gives values."""

    run: Callable[[], None]
    slots: list[Slot]
    names: list[str]


def initializer(model: nn.Module, init_missing: ModuleInit | None) -> ModuleInit | None:
    """How ``model`` initializes one module: ``init_missing``, else a Hugging Face model's ``_init_weights``."""
    if init_missing is not None:
        return init_missing
    hf = getattr(model, "_init_weights", None)  # a PeftModel forwards it to its base model
    return hf if callable(hf) else None


def module_jobs(model: nn.Module, names: list[str], init: ModuleInit | None) -> tuple[list[InitJob], list[str]]:
    """A job per module owning one of ``names`` (model names); and the names no function can initialize."""
    modules = dict(model.named_modules(remove_duplicate=False))
    by_owner: dict[int, tuple[nn.Module, list[str]]] = {}
    for name in names:
        owner = modules[name.rpartition(".")[0]]
        by_owner.setdefault(id(owner), (owner, []))[1].append(name)
    jobs, orphans = [], []
    for owner, owned in by_owner.values():
        fn = init if init is not None else getattr(owner, "reset_parameters", None)
        if not callable(fn):
            orphans.extend(owned)
            continue
        run = (lambda m=owner, f=fn: f(m)) if init is not None else fn
        jobs.append(InitJob(run, [(owner, n) for n, p in owner._parameters.items() if p is not None], owned))
    return jobs, orphans


def unsupported(model: nn.Module, jobs: list[InitJob]) -> list[str]:
    """The slots of ``jobs`` that cannot be initialized at full size: DTensors ``fully_shard`` does not manage
    alone (tensor parallel, or not managed at all); checked before anything is written."""
    shards = {id(p.parameter): p for _, group in groups_in(model) for p in group_facts(group).params}
    bad = []
    for job in jobs:
        for module, name in job.slots:
            tensor = module._parameters[name]
            facts = shards.get(id(tensor))
            if isinstance(tensor, DTensor) and (facts is None or facts.tensor_parallel):
                bad.append(f"{type(module).__name__}.{name}")
    return bad


@torch.no_grad()
def run_jobs(model: nn.Module, jobs: list[InitJob]) -> None:
    """Run every job, each with its slots' sharded parameters swapped for full-size tensors, rows kept after."""
    if not jobs:
        return
    with _rank0_random(model):
        for job in jobs:
            with full_size(job.slots, fill=None):
                job.run()


@contextlib.contextmanager
def full_size(slots: list[Slot], fill: Callable[[DTensor], torch.Tensor] | None) -> Iterator[None]:
    """Hold each DTensor parameter of ``slots`` at full size (``fill(shard)``'s value, or empty) while the body
    runs; with ``fill=None`` write this rank's rows into the shard afterwards. The shards are put back."""
    swapped: list[tuple[nn.Module, str, DTensor, nn.Parameter]] = []
    try:
        for module, name in slots:
            shard = module._parameters[name]
            if not isinstance(shard, DTensor) or any(shard is s for _, _, s, _ in swapped):
                continue  # a plain tensor is full already (the body writes it in place), or tied: swapped once
            local = shard.to_local()
            full = fill(shard) if fill is not None else torch.empty(shard.shape, dtype=shard.dtype, device=local.device)
            module._parameters[name] = nn.Parameter(full, requires_grad=shard.requires_grad)
            swapped.append((module, name, shard, module._parameters[name]))
        yield
        if fill is None:
            for _, _, shard, full in swapped:
                write_full(shard, full)
    finally:
        for module, name, shard, _ in swapped:
            module._parameters[name] = shard


@contextlib.contextmanager
def _rank0_random(model: nn.Module) -> Iterator[None]:
    """Every rank draws from rank 0's random state (CPU, and the shards' accelerator); restored afterwards."""
    kind = next((t.device.type for t in model.parameters() if t.device.type not in ("cpu", "meta")), None)
    devices = [torch.get_device_module(kind).current_device()] if kind else []
    with torch.random.fork_rng(devices=devices, device_type=kind or "cuda"):
        if dist.is_initialized() and dist.get_world_size() > 1:
            module = torch.get_device_module(kind) if kind else None
            state = [(torch.get_rng_state(), module.get_rng_state() if module else None)]
            dist.broadcast_object_list(state, src=0)
            torch.set_rng_state(state[0][0])
            if module is not None:
                module.set_rng_state(state[0][1])
        yield
