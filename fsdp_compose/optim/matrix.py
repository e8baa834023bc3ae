"""Muon on row-sharded matrices, each whole matrix computed once, by one owner rank.

Newton-Schulz orthogonalizes a whole matrix: run on one rank's rows it gives a different (wrong)
update. ``torch.optim.Muon`` on ``Shard(0)`` DTensors gets the right answer by DTensor ops, but every
rank then computes every full matrix and each matmul gathers. Here each matrix has one owner in its
shard group: gradients' rows travel to the owners in one collective, each owner keeps that matrix's
momentum and runs Newton-Schulz on it, and the update's rows travel back in one more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .exchange import Matrix, ShardGroup, assign_owners, chunk_rows, gather_to_owners, scatter_from_owners
from .state import MOMENTUM, momentum_to_shards, shards_to_momentum

UpdateFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
MUON_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate orthogonalization ``U V^T`` of ``matrix`` by a quintic Newton-Schulz iteration in bf16.

    Works on the wide orientation (fewer rows than columns) so the Gram matrix is the small one.
    """
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*G + c*G^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-shape learning rate, so rectangular matrices get updates of comparable RMS."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw": RMS like AdamW's


def muon_momentum(grad: torch.Tensor, state: dict[str, Any], momentum: float, nesterov: bool) -> torch.Tensor:
    """The matrix Muon orthogonalizes: the momentum buffer, or its Nesterov look-ahead; the gradient at momentum 0."""
    if momentum == 0:
        return grad
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(grad)
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _shard_group_of(param: torch.Tensor) -> ShardGroup:
    if not isinstance(param, DTensor):
        return ShardGroup(None, 1, 0)
    mesh = param.device_mesh
    return ShardGroup(mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))


def _unsupported(param: torch.Tensor) -> str | None:
    """Why ``param`` cannot take this path, or None."""
    if param.ndim != 2:
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
    """The parameters sharing one shard group, with their owners (fixed at planning)."""

    shard_group: ShardGroup
    params: list[torch.Tensor] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)


class OwnerComputedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for ``Shard(0)`` DTensor matrices, each computed by one owner rank.

    Arguments are ``torch.optim.Muon``'s; ``update_fn(matrix, state) -> update``, if given, replaces
    Newton-Schulz: it receives the owner's whole momentum matrix (the gradient at ``momentum=0``) and that
    parameter's state dict on the owner, where it may keep its own buffers. Plain tensors are computed
    locally. Gradients must be present on all ranks of a shard group alike, as ``fully_shard`` gives them.
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
    ) -> None:
        _check_hyperparameters(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        self.update_fn = update_fn
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
                "OwnerComputedMuon updates 2-D matrices (Shard(0) DTensors or plain tensors); give these to another "
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
                bucket.params.append(p)
                bucket.groups.append(group)
        for bucket in buckets.values():
            bucket.owners = assign_owners([p.numel() for p in bucket.params], bucket.shard_group.size)
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
        sg = bucket.shard_group
        active = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not active:
            return
        params = [bucket.params[i] for i in active]
        groups = [bucket.groups[i] for i in active]
        matrices = [
            Matrix(p.shape[0], p.shape[1], bucket.owners[i], tuple(chunk_rows(p.shape[0], sg.size)))
            for i, p in zip(active, params)
        ]
        grads = [_local(p.grad) for p in params]
        dtype = _common_dtype(grads)
        if sg.group is None:
            owned = {i: g for i, g in enumerate(grads)}
        else:
            owned = gather_to_owners(sg, matrices, grads, dtype)
        updates = {i: self._update(params[i], full.to(grads[i].dtype), groups[i]) for i, full in owned.items()}
        if sg.group is None:
            rows = list(updates.values())
        else:  # Newton-Schulz's updates are bf16: they travel as such, exactly; update_fn's in the gradients' dtype
            back = torch.bfloat16 if self.update_fn is None else dtype
            rows = scatter_from_owners(sg, matrices, updates, back)
        for p, group, update in zip(params, groups, rows):
            _apply(p, update, group)
            # an entry on every rank (empty off the owner): torch's checkpoint helpers take a non-empty
            # ``optim.state`` as "stepped", and a rank owning nothing must not take it otherwise (it would step alone)
            self.state.setdefault(p, {})
            if sg.group is not None and group["momentum"] != 0:
                self._has_momentum.add(id(p))

    def state_dict(self) -> dict[str, Any]:
        """torch's format; each sharded matrix's momentum as a DTensor laid out like its parameter.

        Collective: one ``all_to_all_single`` per shard group sends the owners' whole buffers out as row shards,
        so ``torch.distributed.checkpoint`` saves and reshards them. Other state an ``update_fn`` keeps on the
        owner is passed through as it is (plain, on the owner only).
        """
        state_dict = super().state_dict()
        index = _param_indices(self.param_groups)
        for bucket in self._plan():
            if bucket.shard_group.group is None:
                continue
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

    def _update(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The owner's whole-matrix update: momentum, then Newton-Schulz or ``update_fn``."""
        state = self.state[param]
        matrix = muon_momentum(grad, state, group["momentum"], group["nesterov"])
        if self.update_fn is not None:
            return self.update_fn(matrix, state)
        return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's index in torch's optimizer state dict (in group order, each parameter once)."""
    index: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def _ranks_of(sg: ShardGroup) -> tuple[int, ...] | None:
    """A shard group's key: its ranks. Meshes of one layout may carry distinct process-group objects over the
    same ranks (torch caches some): their matrices are still one bucket, one collective each way."""
    return None if sg.group is None else tuple(dist.get_process_group_ranks(sg.group))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _apply(param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
    """Decoupled weight decay at the plain lr, then the update at Muon's shape-adjusted lr, on the local rows."""
    local = _local(param)
    lr = group["lr"]
    local.mul_(1 - lr * group["weight_decay"])
    local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))


def _check_hyperparameters(
    lr: float, weight_decay: float, momentum: float, coefficients: tuple, steps: int, adjust_lr_fn: str | None
) -> None:
    if isinstance(lr, torch.Tensor):
        raise ValueError("OwnerComputedMuon takes a float lr (a tensor lr is not supported yet)")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {coefficients}")
    if not 0 < steps < 100:
        raise ValueError(f"ns_steps must be in 1..99, got {steps}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
