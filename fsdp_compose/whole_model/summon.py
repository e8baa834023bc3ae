"""``summon_full_params``: the whole model's full parameters, for inspection or surgery.

Inside the context every managed parameter is registered on its module(s) as a plain full
tensor (a DTensor in its TP layout under tensor parallelism), gathered from the shards as
``full_state_dict`` gathers them (``full_gather.py``); on exit each rank's rows are
copied back into its shard (``writeback``), and the sharded DTensors are registered again. The
groups stay sharded; their full parameters are all held at once, so this costs the memory of
the whole model; use it outside forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .._runtime.params import ShardedParam
from .full_gather import gather_full_params
from .model_groups import group_states, reshard_idle


def _expose(p: ShardedParam, full: torch.Tensor, offload_to_cpu: bool, grad: torch.Tensor | None) -> nn.Parameter:
    """Register ``full`` as ``p``'s parameter on every module that holds it, and return it."""
    if offload_to_cpu and full.device.type != "cpu":
        full = full.to("cpu", copy=True)
    full = nn.Parameter(full, requires_grad=p.requires_grad)
    if grad is not None:
        full.grad = grad.to(full.device)
    for place in p.places:
        place.module._parameters[place.name] = full
    return full


@torch.no_grad()
def _write_back(p: ShardedParam, full: nn.Parameter, with_grads: bool) -> None:
    p.local_tensor().copy_(p.shard_of(full))
    sharded_grad = p.sharded_param.grad
    if with_grads and full.grad is not None and sharded_grad is not None:
        sharded_grad.to_local().copy_(p.shard_of(full.grad))


@contextmanager
def summon_full_params(
    module: nn.Module,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose full parameters on every ``fully_shard`` module under ``module``.

    Args:
        writeback: copy edits made inside the context back into the shards on exit.
        rank0_only: only global rank 0 sees full parameters; the others keep their shards
            (incompatible with ``writeback``: the ranks would disagree on the result).
        offload_to_cpu: expose CPU copies (a no-op where parameters already live on CPU).
        with_grads: also expose full gradients as ``.grad`` (written back too with ``writeback``).

    Must be entered on every rank (it all-gathers).
    """
    if writeback and rank0_only:
        raise ValueError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported: only rank 0 "
            "would hold the edited parameters; pass writeback=False"
        )
    reshard_idle(module, "summon_full_params")  # the modules hold the sharded DTensors again
    keep = not rank0_only or dist.get_rank() == 0
    exposed: list[tuple[ShardedParam, nn.Parameter]] = []
    try:
        for state in group_states(module):
            params = state.group.params
            grads = [
                p.sharded_param.grad.full_tensor() if with_grads and p.sharded_param.grad is not None else None
                for p in params
            ]
            fulls = gather_full_params(params, keep=keep, to_all=not rank0_only, as_module=True)
            if keep:
                exposed += [(p, _expose(p, full, offload_to_cpu, grad)) for p, full, grad in zip(params, fulls, grads)]
        yield
    finally:
        if writeback:
            for p, full in exposed:
                _write_back(p, full, with_grads)
        for p, full in exposed:
            full.grad = None  # full gradients live as long as the context
            p.use(unsharded=False)
