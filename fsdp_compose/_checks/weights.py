"""Ranks that train with different weights fail at the first forward, not after days of a mixed model.

Each rank's shard is cut from its own copy of a parameter, so ranks that built different values
(``torch.manual_seed(rank)`` before the model, pretrained weights loaded on rank 0 only) train a
mix of several initialisations, in silence (torch's FSDP2 too). ``fully_shard`` is the one moment
every rank still holds a whole copy: it compares each parameter's float64 sum and sum of squares
across the data-parallel ranks as the divergence check compares its rounds
(``order.disagreement``), and only records the verdict. Building a model without a seed and
loading a checkpoint after sharding is right, so the error waits for the root's first forward
(lazy init) and names only the parameters whose shards no rank wrote since (a load through
``load_state_dict``, DCP, ``set_model_state_dict`` or ``load_checkpoint``, an in-place init under
``torch.no_grad()``, a broadcast): each rank compares its shard's fingerprint with the one taken at
``fully_shard``, and one all-reduce of those flags lets every rank raise together. Version counters would
miss writes through ``.data``, ``to_local()`` or a collective, which bump none. Both the extra fingerprint
and the all-reduce happen only for a group whose ranks differed.
A parameter on meta (no values yet) or a tensor subclass (its own arithmetic) is fingerprinted as
having none, so every rank takes part in the all-reduce whatever it holds: all-meta ranks agree, and a
rank holding values differs from meta ones until the broadcast or load they need writes their shards.
Skipped: fake parameters, a world of one, ranks that are threads of one process (torch's ``threaded`` test backend: they share one
random generator, so no seed can make them build alike, and torch's own FSDP2 tests train such values),
and ``FSDP_COMPOSE_DISABLE=weights_check`` or the older ``FSDP_COMPOSE_CHECK_INIT=0`` (ranks that differ on
purpose; every opt-out is listed with ``fsdp_compose.process_wide_effects``).
"""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

from .order import disagreement
from .._runtime.params import ShardedParam
from .._runtime.process_wide import disabled
from .._runtime.state import GroupState

CHECK_ENV = "FSDP_COMPOSE_CHECK_INIT"
THREADED_BACKEND = "threaded"  # torch.testing's multi-threaded process group: every rank a thread of one process


def unequal_values(owner: str, params: dict[str, torch.Tensor], mesh: DeviceMesh, device: torch.device) -> list[str]:
    """The names of ``params`` (name -> full value) whose values differ across the data-parallel ranks of
    ``mesh``: a collective, the same answer on every rank."""
    # disabled() first, at every call: a misspelt FSDP_COMPOSE_DISABLE raises before fully_shard commits
    if disabled("weights_check") or os.environ.get(CHECK_ENV, "1") == "0":
        return []
    if not params or mesh.size() == 1 or _thread_ranks(mesh):
        return []
    pieces = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in params.items()}  # TP: this rank's
    if any(is_fake(v) for v in pieces.values()):  # a fake run: every rank fake, nothing to compare
        return []
    # every rank sends one fingerprint per parameter, values or not: a rank that skipped the all-reduce
    # (its model on meta while rank 0's holds pretrained weights) would leave the others waiting in it
    differs = differ_across_ranks(list(pieces.values()), mesh, device, f"fully_shard({owner})'s comparison of weights")
    return [name for name, different in zip(pieces, differs) if different]


def differ_across_ranks(values: list[torch.Tensor], mesh: DeviceMesh, device: torch.device, name: str) -> list[bool]:
    """For each of ``values``, whether the ranks of ``mesh`` hold different ones (their ``_fingerprint``s
    compared as ``order.disagreement`` compares its rounds): one all-reduce per mesh dim, the same
    answer on every rank. The weights check compares parameters; the optimizer check, gradients."""
    with torch.no_grad():
        prints = torch.stack([_fingerprint(v, device) for v in values]).flatten()
        found = disagreement(torch.cat([prints, -prints]), _groups(mesh), name)
        return (found[: prints.numel()] | found[prints.numel() :]).view(-1, 2).any(dim=1).tolist()


def defer_verdict(state: GroupState, unequal: list[str]) -> None:
    """Leave the verdict on ``unequal`` (``state``'s parameter names) for the root's first forward, with a
    fingerprint of each one's local shard as cut: a later write changes it, whichever way it came."""
    if not unequal:
        return
    by_name = {p.fqn: p for p in state.group.params}
    recorded = [by_name[name] for name in unequal]
    state.first_forward_checks.append(partial(_raise_if_unwritten, state, recorded, _local_prints(state, recorded)))


def _local_prints(state: GroupState, params: list[ShardedParam]) -> torch.Tensor:
    """Each local shard's fingerprint (``_fingerprint``), on the group's device."""
    with torch.no_grad():
        return torch.stack([_fingerprint(p.local_tensor().detach(), state.group.device) for p in params])


def _fingerprint(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value``'s float64 sum and sum of squares on ``device`` (nothing read on the host; NaN as 1e300, so it
    compares equal to itself). A value without data here (on meta) or with arithmetic of its own (a tensor
    subclass: float8, NF4, the extension protocol's) reads as -1, -1, unlike any real one (a sum of squares is
    never negative): a rank on meta differs from one holding values, and a later write changes it."""
    if value.is_meta or type(value) not in (torch.Tensor, nn.Parameter):
        return torch.full((2,), -1.0, dtype=torch.float64, device=device)
    found = torch.stack([value.double().sum(), value.double().square().sum()])
    return torch.nan_to_num(found.to(device), nan=1.0e300)


def _raise_if_unwritten(state: GroupState, recorded: list[ShardedParam], cut: torch.Tensor, where: str) -> None:
    """Raise, on every rank, for the recorded parameters whose shard no rank of the mesh wrote since
    ``fully_shard`` (one rank writing is enough: HSDP loads on one replica and broadcasts to the others)."""
    with torch.no_grad():
        written = (_local_prints(state, recorded) != cut).any(dim=1).double()
        # where a rank's flag differs, some rank wrote: the all-reduce (max) reaches every rank of the mesh
        anywhere = (written.bool() | disagreement(written, _groups(state.group.mesh), _name(state))).tolist()
    names = [p.fqn for p, written_somewhere in zip(recorded, anywhere) if not written_somewhere]
    if names:
        raise ValueError(_message(state, names, where))


def _name(state: GroupState) -> str:
    return f"the first forward's check of fully_shard({state.group.class_name})'s initial weights"


def _message(state: GroupState, names: list[str], where: str) -> str:
    listed = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"fully_shard({state.group.class_name}) of '{where}': ranks hold different values of {listed}; each rank's "
        "shard came from its own copy at fully_shard and nothing was loaded into it since, so the model would train "
        "as a mix of several initialisations. Build the model with the same seed on every rank (torch.manual_seed "
        "before building it), load pretrained weights on every rank (before fully_shard, or into the sharded model "
        "before its first forward), or make them equal first (fsdp_compose.sync_module_states(model) before "
        f"fully_shard). If ranks differ on purpose, set FSDP_COMPOSE_DISABLE=weights_check (or {CHECK_ENV}=0)"
    )


def _thread_ranks(mesh: DeviceMesh) -> bool:
    """Whether the ranks are threads of one process (torch's test backend), sharing one random generator."""
    return any(dist.get_backend(group) == THREADED_BACKEND for group in _groups(mesh))


def _groups(mesh: DeviceMesh) -> tuple:
    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
