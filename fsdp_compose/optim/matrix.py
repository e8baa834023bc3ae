"""Muon on row-sharded matrices, each whole matrix computed once, by one owner rank.

Newton-Schulz orthogonalizes a whole matrix: run on one rank's rows it gives a different (wrong)
update. ``torch.optim.Muon`` on ``Shard(0)`` DTensors gets the right answer by DTensor ops, but every
rank then computes every full matrix and each matmul gathers. Here each matrix has one owner in its
shard group: gradients' rows travel to the owners in one collective, each owner keeps that matrix's
momentum and runs Newton-Schulz on it, and the update's rows travel back in one more.

A 3-D parameter ``(E, m, n)`` (expert weights) is a batch of ``E`` matrices. Sharded ``Shard(0)`` on the
batch dim, each rank already holds whole matrices: it computes its own, with no collective, and keeps
their momentum; the 2-D matrices' owners are then balanced around that load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..extras_api import row_layout
from .exchange import Matrix, Route, ShardGroup, assign_owners
from .muon import (
    MUON_COEFFICIENTS,
    adjusted_lr,
    check_hyperparameters,
    momentum_buffer,
    muon_momentum,
    muon_momentum_rows,
    newton_schulz,
    newton_schulz_work,
)
from .state_dict import MOMENTUM, common_dtype, momentum_to_shards, param_indices, rows_like, shards_to_momentum

UpdateFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]


def _shard_group_of(param: torch.Tensor) -> ShardGroup:
    if not isinstance(param, DTensor):
        return ShardGroup(None, 1, 0, param.device)
    mesh, dim = param.device_mesh, param.device_mesh.ndim - 1
    return ShardGroup(mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim), param.device)


def _unsupported(param: torch.Tensor) -> str | None:
    """Why ``param`` cannot take this path, or None."""
    if param.ndim not in (2, 3):
        return f"{param.ndim}-D, shape {tuple(param.shape)}"
    if torch.is_complex(param):
        return "complex"
    if isinstance(param, DTensor):
        *outer, last = param.placements
        if not (isinstance(last, Shard) and last.dim == 0) or not all(p.is_replicate() for p in outer):
            return f"placements {tuple(param.placements)}; supported: Shard(0) on the last mesh dim, Replicate before"
    return None


@dataclass
class _Bucket:
    """The parameters sharing one shard group, with their owners (fixed at planning).

    ``params``: 2-D matrices, each computed by its owner; ``batches``: 3-D batches of matrices, each rank
    computing the matrices it holds."""

    shard_group: ShardGroup
    params: list[torch.Tensor] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    batches: list[torch.Tensor] = field(default_factory=list)
    batch_groups: list[dict[str, Any]] = field(default_factory=list)
    _route: tuple[tuple[int, ...], Route] | None = None

    def route(self, active: list[int]) -> Route:
        """The collectives' layout for the matrices in ``active`` (indices into ``params``), kept for the next step."""
        if self._route is None or self._route[0] != tuple(active):
            size = self.shard_group.size
            matrices = [Matrix.from_shape(self.params[i].shape, self.owners[i], size) for i in active]
            self._route = (tuple(active), Route(self.shard_group, matrices))
        return self._route[1]


class OwnerComputedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for ``Shard(0)`` DTensor matrices, each computed by one owner rank.

    Arguments are ``torch.optim.Muon``'s; ``update_fn(matrix, state) -> update``, if given, replaces
    Newton-Schulz: it receives the owner's whole momentum matrix (the gradient at ``momentum=0``) and that
    parameter's state dict on the owner, where it may keep its own buffers. 3-D parameters ``(E, m, n)`` are
    batches of ``E`` matrices (expert weights): each rank computes the matrices it holds, and ``update_fn``
    receives that ``(e, m, n)`` batch. Plain tensors are computed locally. Gradients must be present on all
    ranks of a shard group alike, as ``fully_shard`` gives them. ``keep_buffers``: keep the two flat buffers
    the collectives use between steps (about this rank's gradient rows twice, in their dtype), so a step does
    not page in fresh memory; False frees them after each step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        update_fn: UpdateFn | None = None,
        keep_buffers: bool = True,
    ) -> None:
        check_hyperparameters(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        self.update_fn = update_fn
        self.keep_buffers = keep_buffers
        self._check_params()
        self._buckets: list[_Bucket] = []
        self._planned_for: tuple[int, ...] = ()
        self._has_momentum: set[int] = set()  # ids of sharded matrices whose owner holds momentum (known on all ranks)

    def _check_params(self) -> None:
        bad = []
        for g, group in enumerate(self.param_groups):
            default = [f"param_groups[{g}]['params'][{i}]" for i in range(len(group["params"]))]
            names = group.get("param_names") or default
            bad += [f"{name} ({why})" for name, p in zip(names, group["params"]) if (why := _unsupported(p))]
        if bad:
            raise ValueError(
                "OwnerComputedMuon updates 2-D matrices and 3-D batches of them (Shard(0) DTensors or plain tensors); "
                "give these to another "
                "optimizer such as torch.optim.AdamW: " + ", ".join(bad)
            )

    def _plan(self) -> list[_Bucket]:
        """Parameters by shard group, in parameter order, and their owners; redone when param groups change."""
        key = tuple(id(p) for group in self.param_groups for p in group["params"])
        if key == self._planned_for:
            return self._buckets
        self._check_params()
        buckets: dict[Any, _Bucket] = {}
        for group in self.param_groups:
            for p in group["params"]:
                sg = _shard_group_of(p)
                bucket = buckets.setdefault(_ranks_of(sg), _Bucket(sg))
                if p.ndim == 3:
                    bucket.batches.append(p)
                    bucket.batch_groups.append(group)
                else:
                    bucket.params.append(p)
                    bucket.groups.append(group)
        for bucket in buckets.values():
            size = bucket.shard_group.size
            held = [0] * size  # Newton-Schulz work of the 3-D batches' matrices each rank holds and computes
            for p in bucket.batches:
                rows = row_layout(p.shape, 0, size, 0)
                for r in range(size):
                    held[r] += rows.rows_of(r)[1] * newton_schulz_work(p.shape[1], p.shape[2])
            bucket.owners = assign_owners([newton_schulz_work(*p.shape) for p in bucket.params], size, held)
        self._buckets, self._planned_for = list(buckets.values()), key
        return self._buckets

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every matrix with a gradient: two collectives per shard group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self._plan():
            self._step_bucket(bucket)
        return loss

    def _step_bucket(self, bucket: _Bucket) -> None:
        active = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if bucket.shard_group.group is None or not active:
            self._step_batches(bucket)
            for i in active:  # plain tensors: every rank holds them whole
                self._step_local(bucket.params[i], bucket.groups[i])
            return
        sg, route = bucket.shard_group, bucket.route(active)
        params = [bucket.params[i] for i in active]
        groups = [bucket.groups[i] for i in active]
        grads = [_local(p.grad) for p in params]
        dtype = common_dtype(grads)
        gathering = route.start_gather(grads, dtype)
        # while the rows travel: the 3-D batches, and this rank's own rows of the matrices it owns
        self._step_batches(bucket)
        targets = {i: self._momentum_target(params[i], grads[i], groups[i]) for i in route.mine}
        for i in route.mine:
            self._momentum_rows(targets[i], grads[i], route.matrices[i].row_start(sg.rank), groups[i])
        for i, pieces in route.owned_rows(gathering.wait()).items():
            for rank, first, rows in pieces:
                if rank != sg.rank:
                    self._momentum_rows(targets[i], rows.to(grads[i].dtype), first, groups[i])
        # contiguous: a tall matrix's update is Newton-Schulz's wide result transposed, and one blocked transpose
        # here is cheaper than copying and applying its rows strided
        updates = {i: self._orthogonalize(params[i], _matrix_of(t), groups[i]).contiguous() for i, t in targets.items()}
        # Newton-Schulz's updates are bf16: they travel as such, exactly; update_fn's in the gradients' dtype
        back = torch.bfloat16 if self.update_fn is None else dtype
        scattering = route.start_scatter(updates, back)
        # while the updates travel: this rank's own rows of the matrices it owns
        for i in route.mine:
            m = route.matrices[i]
            _apply(params[i], updates[i].narrow(0, m.row_start(sg.rank), m.row_counts[sg.rank]).to(back), groups[i])
        held = route.held_rows(scattering.wait())
        for i, (p, group) in enumerate(zip(params, groups)):
            if route.matrices[i].owner != sg.rank:
                _apply(p, held[i], group)
            # an entry on every rank (empty off the owner): torch's checkpoint helpers take a non-empty
            # ``optim.state`` as "stepped", and a rank owning nothing must not take it otherwise (it would step alone)
            self.state.setdefault(p, {})
            if group["momentum"] != 0:
                self._has_momentum.add(id(p))
        if not self.keep_buffers:
            route.release()

    def _step_batches(self, bucket: _Bucket) -> None:
        for p, group in zip(bucket.batches, bucket.batch_groups):
            if p.grad is not None:
                self._step_local(p, group)

    def _momentum_target(
        self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An owned matrix's ``(momentum buffer, matrix to orthogonalize)``, whole, before its rows arrive, on
        ``grad``'s (this rank's rows') device.

        The buffer is None at ``momentum=0``; the matrix is None where it is the buffer itself (plain momentum),
        else bf16 for Newton-Schulz (its first cast, done as the rows are written) or ``grad``'s dtype for
        ``update_fn``.
        """
        buf = None
        if group["momentum"] != 0:
            buf = momentum_buffer(self.state[param], param.shape, grad)
            if not group["nesterov"]:
                return buf, None
        dtype = torch.bfloat16 if self.update_fn is None else grad.dtype
        return buf, torch.empty(param.shape, dtype=dtype, device=grad.device)

    @staticmethod
    def _momentum_rows(
        target: tuple[torch.Tensor | None, torch.Tensor | None], rows: torch.Tensor, first: int, group: dict[str, Any]
    ) -> None:
        buf, out = (None if t is None else t.narrow(0, first, rows.shape[0]) for t in target)
        muon_momentum_rows(rows, buf, out, group["momentum"])

    def _step_local(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """Matrices this rank holds whole, updated where they are with no collective: a plain tensor, or this
        rank's matrices of a 3-D batch (its ``Shard(0)`` rows)."""
        grad = _local(param.grad)
        matrix = muon_momentum(grad, self.state[param], group["momentum"], group["nesterov"])
        # an empty ``matrix``: this rank holds none of the batch (more ranks than matrices)
        _apply(param, self._orthogonalize(param, matrix, group) if grad.numel() else matrix, group)

    def owned_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds, for ``explain``: what its state holds once stepped; before
        that, the momentum it will hold (each whole matrix it owns, its rows of 3-D batches). Local, read-only."""
        if self.state:
            return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
        total = 0
        for bucket in self._plan():
            me = bucket.shard_group.rank
            for p, group, owner in zip(bucket.params, bucket.groups, bucket.owners):
                if p.requires_grad and group["momentum"] != 0 and owner == me:
                    total += p.numel() * p.element_size()
            for p, group in zip(bucket.batches, bucket.batch_groups):
                if p.requires_grad and group["momentum"] != 0:
                    total += _local(p).numel() * p.element_size()
        return total

    def collectives_per_step(self) -> tuple[int, int]:
        """``(calls, bytes)`` this rank issues in one ``step()``, for ``explain``: two ``all_to_all_single`` per
        shard group with a trainable 2-D matrix; bytes are this rank's inputs to them (its gradient rows to other
        owners, other ranks' rows of its owned matrices' updates). From shapes alone: local, read-only."""
        calls = nbytes = 0
        for bucket in self._plan():
            sg = bucket.shard_group
            trained = [(p, o) for p, o in zip(bucket.params, bucket.owners) if p.requires_grad]
            if sg.group is None or not trained:
                continue
            dtype = common_dtype([p for p, _ in trained])
            back = torch.bfloat16 if self.update_fn is None else dtype
            calls += 2
            for p, owner in trained:
                mine = row_layout(p.shape, 0, sg.size, sg.rank).local_numel
                nbytes += (p.numel() - mine) * back.itemsize if owner == sg.rank else mine * dtype.itemsize
        return calls, nbytes

    def state_dict(self) -> dict[str, Any]:
        """torch's format; each sharded matrix's momentum as a DTensor laid out like its parameter.

        Collective: one ``all_to_all_single`` per shard group sends the owners' whole buffers out as row shards,
        so ``torch.distributed.checkpoint`` saves and reshards them. Other state an ``update_fn`` keeps on the
        owner is passed through as it is (plain, on the owner only).
        """
        state_dict = super().state_dict()
        index = param_indices(self.param_groups)
        for bucket in self._plan():
            if bucket.shard_group.group is None:
                continue
            for p in bucket.batches:  # each rank's rows already: laid out like the parameter, no collective
                buf = self.state.get(p, {}).get(MOMENTUM)
                if buf is not None:
                    entry = dict(state_dict["state"][index[id(p)]])
                    entry[MOMENTUM] = DTensor.from_local(
                        buf.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                    state_dict["state"][index[id(p)]] = entry
            held = [(p, o) for p, o in zip(bucket.params, bucket.owners) if id(p) in self._has_momentum]
            shards = momentum_to_shards(bucket.shard_group, [p for p, _ in held], [o for _, o in held], self.state)
            for (p, _), shard in zip(held, shards):
                entry = dict(state_dict["state"].get(index[id(p)], {}))
                entry[MOMENTUM] = shard
                state_dict["state"][index[id(p)]] = entry
        state_dict["state"] = dict(sorted(state_dict["state"].items()))  # the same order on every rank
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s format: each matrix's momentum rows go to its owner as one whole buffer.

        Collective: one ``all_to_all_single`` per shard group. The owners may differ from the saving run's
        (another world size): they are this run's.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        # saved index -> this optimizer's parameter, as torch's load_state_dict maps them
        by_saved = {i: p for s, g in zip(saved_groups, self.param_groups) for i, p in zip(s["params"], g["params"])}
        saved_index = {id(p): i for i, p in by_saved.items()}
        state = {k: dict(v) for k, v in state_dict["state"].items()}
        loaded: set[int] = set()
        for bucket in self._plan():
            if bucket.shard_group.group is None:
                continue
            for p in bucket.batches:
                entry = state.get(saved_index[id(p)], {})
                if MOMENTUM in entry:
                    entry[MOMENTUM] = rows_like(entry[MOMENTUM], p)
            held = [(p, o) for p, o in zip(bucket.params, bucket.owners)
                    if MOMENTUM in state.get(saved_index[id(p)], {})]
            params = [p for p, _ in held]
            shards = [state[saved_index[id(p)]].pop(MOMENTUM) for p in params]
            owned = shards_to_momentum(bucket.shard_group, params, [o for _, o in held], shards)
            for i, p in enumerate(params):
                if i in owned:
                    state[saved_index[id(p)]][MOMENTUM] = owned[i]
                loaded.add(id(p))
        state = {k: v for k, v in state.items() if v}
        super().load_state_dict({**state_dict, "state": state})
        self._has_momentum = loaded
        params = {id(p): p for group in self.param_groups for p in group["params"]}
        for key in loaded:
            self.state.setdefault(params[key], {})  # an entry on every rank, as step() leaves them

    def _orthogonalize(self, param: torch.Tensor, matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The update of one whole matrix (or 3-D batch) from its momentum matrix: Newton-Schulz or ``update_fn``."""
        if self.update_fn is not None:
            return self.update_fn(matrix, self.state[param])
        return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _ranks_of(sg: ShardGroup) -> tuple[int, ...] | None:
    """A shard group's key: its ranks. Meshes of one layout may carry distinct process-group objects over the
    same ranks (torch caches some): their matrices are still one bucket, one collective each way."""
    return None if sg.group is None else tuple(dist.get_process_group_ranks(sg.group))


def _matrix_of(target: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
    buf, out = target
    return buf if out is None else out  # type: ignore[return-value]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _apply(param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
    """Decoupled weight decay at the plain lr, then the update at Muon's shape-adjusted lr, on the local rows."""
    local = _local(param)
    lr = group["lr"]
    local.mul_(1 - lr * group["weight_decay"])
    local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
