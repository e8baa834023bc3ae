"""ParamGroup: the parameters of one ``fully_shard`` call, unsharded and reduced as a unit."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

from .collectives import (
    DIRECT_ALL_GATHER,
    CommStats,
    GatherLayout,
    PendingCollective,
    all_gather_flat,
    all_reduce_sum,
    copy_out,
    grad_off,
    labelled,
    reduce_scatter_rows,
)
from .._checks.order import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, OrderCheck
from .._torch_workarounds.functorch import outside_transforms
from .param_grad import accumulate_grad, clear_unsharded_grad, padded_grad_rows, unsharded_grad
from .params import ShardedParam
from .settings import GroupSettings
from .uids import new_uid


@dataclass(frozen=True)
class Reduction:
    """One reduce-scatter of a group: a dtype's parameters; every rank's row is their padded rows plus
    a has-gradient flag each (zeros where a short parameter has no row on that rank)."""

    dtype: torch.dtype
    params: tuple[ShardedParam, ...]

    @cached_property
    def row_bytes(self) -> int:
        return (sum(p.row_layout.padded_numel for p in self.params) + len(self.params)) * self.dtype.itemsize


def divide_factors(dtype: torch.dtype, world: int, dp_size: int, factor: float | None) -> tuple[float, float]:
    """What a reduction divides the gradients by before the sum and after it, ``(pre, post)``: ``factor``
    (``set_gradient_divide_factor``) or else the data-parallel size ``dp_size``, in all. The collectives
    only ever sum. 2-byte dtypes divide first, so the sum cannot overflow: by ``factor`` when one was set,
    else by the shard ``world`` (the HSDP replicas' part follows the all-reduce); wider ones divide once,
    after. ``explain`` shows the same figures (``extras_api.group_facts``)."""
    total = dp_size if factor is None else factor
    if dtype.itemsize >= 4:
        return 1, float(total)
    pre = world if factor is None else factor
    return pre, total / pre


@dataclass(eq=False)
class PendingReduce:
    """One reduce-scatter ``ParamGroup.start_reduce`` prepared and the schedule issues (``issue_reduce``):
    its parameters, every rank's rows of them (and the has-gradient flags), and what its result needs."""

    params: tuple[ShardedParam, ...]
    rows: list[torch.Tensor]  # (world, padded) per parameter, then the flag rows; emptied when issued
    process_group: object
    pre_divide: float  # divide the rows before the sum (``divide_factors``; the flags too: they stay > 0)
    post_divide: float  # divide the sum after; 1 for nothing
    all_reduce: bool  # HSDP: all-reduce across replicas now (else keep partial sums)
    # add every reduced shard without reading the summed flags (this rank sent every gradient, or off gloo,
    # where the read is a host sync: a parameter no rank had a gradient for then gets zeros instead of
    # keeping ``.grad``)
    accumulate_all: bool
    present: tuple[bool, ...] = ()  # which parameters had a gradient on this rank


class PostForward(NamedTuple):
    """``reshard_after_forward=<int>``: after forward each rank keeps an N-way slice of every gathered
    column, and backward re-gathers it within its N consecutive ranks (e.g. one node)."""

    ranks: int
    process_group: object


class ParamGroup:
    """Owns the collectives of one group; knows nothing of hooks or modules' forward."""

    def __init__(
        self,
        params: list[ShardedParam],
        mesh: DeviceMesh,
        device: torch.device,
        class_name: str,
        settings: GroupSettings,
        post_forward: PostForward | None = None,
    ) -> None:
        self.class_name = class_name  # the user's class of the call's first module
        self.fqn: str | None = None  # its name in the model, and which mesh when a call has several: set by lazy init
        self.mesh_text = ""
        self.uid = new_uid()  # the n-th group built on this rank: the order checks' id, as on every rank
        self.order_check = OrderCheck(self.uid, device)
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self._reduce_plan: list[Reduction] | None = None  # built by the first reduce (``reduce_plan``)
        self.device = device
        self._all_present: dict = {}  # reduce dtype -> its cached flag rows
        self._gloo: dict[object, bool] = {}  # process group -> whether it is gloo's (``_on_gloo``)
        self._divisors: dict[float, torch.Tensor] = {}  # see _divisor
        # all-gather and reduce-scatter within the shard dim (the last); HSDP adds an
        # all-reduce of the reduced shards across the replicate dim
        self.mesh = mesh
        self.world_size = mesh.size(mesh.ndim - 1)
        self.process_group = mesh.get_group(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)  # this rank's row of the all-gather output
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.dp_size = mesh.size()
        self._partial: dict[torch.dtype, torch.Tensor] = {}  # HSDP sums kept while all-reduce is off
        self.post_forward = post_forward
        self.post_forward_slice: torch.Tensor | None = None
        self.layout = GatherLayout([w for p in params for w in p.form.widths()], self.world_size)
        self._extension_layout = False  # ``layout`` has a column per extension input (see start_unshard)
        self.stats = CommStats()
        self.is_unsharded = False
        self.pending_unshard: PendingCollective | None = None
        self.pending_reduces: list[PendingCollective] = []
        self.settings = settings

    def refresh(self, replaced: dict[ShardedParam, tuple] | None = None) -> None:
        """Re-read the parameters after ``refresh.follow_module``: their shards' device (deferred init
        materialized them), the shards ``replaced`` gives (parameter -> (new shard, its layout)), and
        what depends on their dtypes and ``requires_grad``. The group must be sharded."""
        replaced = replaced or {}
        for p in self.params:
            self.device = p.refresh(*replaced.get(p, ()))
        self.order_check.refresh(self.device)
        self._all_present.clear()
        if not replaced:
            return
        self.trainable = [p for p in self.params if p.requires_grad]
        self._reduce_plan = None
        self.layout = GatherLayout([w for p in self.params for w in p.form.widths()], self.world_size)
        self._partial.clear()
        self.post_forward_slice = None

    # ----- unshard / reshard ------------------------------------------------------------
    @outside_transforms
    def start_unshard(self) -> None:
        """Issue the all-gather unless the group is unsharded or one is in flight: from the shards, or
        within the small group from the slice kept after a ``reshard_after_forward=<int>`` forward."""
        if self.is_unsharded or self.pending_unshard is not None or not self.params:
            if not self.params:
                self.is_unsharded = True
            return
        with grad_off():
            if self.post_forward_slice is not None:  # within the small group, from the slice kept after forward
                pieces, self.post_forward_slice = [self.post_forward_slice], None
                rows, group = self.post_forward
                layout = GatherLayout([size * self.world_size // rows for size in self.layout.sizes], rows)
                rank = self.rank % rows  # in the small group (consecutive ranks)
            else:
                extended, pieces = False, []
                with labelled("copy_in", self):  # casts/moves shards where needed; no concatenation here
                    for p in self.params:
                        pieces.extend(p.gather_pieces())
                        extended = extended or p.form.extension is not None
                if extended or self._extension_layout:  # the protocol chose this step's inputs (columns)
                    widths = [w for p in self.params for w in p.form.widths()]
                    if widths != self.layout.sizes:
                        self.layout = GatherLayout(widths, self.world_size)
                    self._extension_layout = extended
                layout, group, rows, rank = self.layout, self.process_group, self.world_size, self.rank
            self.order_check.check(ALL_GATHER, layout.total, group)
            with labelled("all_gather", self):  # copies the pieces into this rank's row, then issues
                work, gathered = all_gather_flat(
                    pieces, layout, group, self.stats, self.settings.all_gather, rank, layout.total
                )
        finish = partial(self._finish_unshard, gathered, layout, rows, self._frees_gathered(group, gathered))
        self.pending_unshard = PendingCollective(work, finish, name=lambda: f"the all-gather of {self.label}")

    @property
    def label(self) -> str:
        """How errors name the group: ``'blocks.3' (Block)``; before the first forward, the class name."""
        return self.class_name if self.fqn is None else f"'{self.fqn}' ({self.class_name}){self.mesh_text}"

    @outside_transforms
    def _finish_unshard(self, gathered: torch.Tensor, layout: GatherLayout, rows: int, free: bool) -> None:
        with grad_off(), labelled("copy_out", self):  # into (world, padded bytes) targets, one per extension input
            targets = [t for p in self.params for t in p.form.targets(p)]
            if rows != self.world_size:
                targets = [t.view(rows, -1) for t in targets]
            copy_out(gathered, layout, targets, free)
            slice_follows = self.post_forward is not None and rows == self.world_size  # kept after forward
            for p in self.params:
                p.form.finish(p, slice_follows)
                p.use(unsharded=True)
        self.is_unsharded = True

    def wait_unshard(self) -> None:
        pending, self.pending_unshard = self.pending_unshard, None
        if pending is not None:
            with labelled("wait", self):
                pending.finish()

    def unshard(self) -> None:
        if self.pending_unshard is None:  # else prefetched (the usual case): start_unshard would return at once
            self.start_unshard()
        self.wait_unshard()

    @outside_transforms
    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded storage and register the shards again (``after_forward`` with a post-forward
        group keeps this rank's N-way slice for backward)."""
        if self.pending_unshard is not None:  # a prefetched all-gather nothing used
            self.wait_unshard()
        if not after_forward:
            self.post_forward_slice = None
        if not self.is_unsharded:
            return
        # (an unsharded group kept no slice: its all-gather took it)
        if after_forward and self.post_forward is not None and self.params:  # an empty group keeps nothing
            ranks, index = self.post_forward.ranks, self.rank % self.post_forward.ranks  # this rank's N-way slice
            with grad_off():
                self.post_forward_slice = torch.cat([t.view(ranks, -1)[index] for p in self.params for t in p.form.rows(p)])
        for p in self.params:
            p.use(unsharded=False)
            p.form.free()
        self.is_unsharded = False

    def unsharded_nbytes(self) -> int:
        """Bytes held for unsharded use now: gathered parameters, or the post-forward slice."""
        kept = self.post_forward_slice.numel() if self.post_forward_slice is not None else 0
        return kept + sum(p.form.nbytes() for p in self.params)

    # ----- gradients --------------------------------------------------------------------
    def start_reduce(self, all_reduce: bool = True) -> list[PendingReduce]:
        """Prepare the reduce-scatter of every trainable parameter's unsharded gradient, one per dtype, and
        return them as records the schedule issues (``issue_reduce``; on gloo after the next order check: see
        [Note: gloo reduce-scatter deferral] in ``schedule.py``).

        A parameter without a gradient here sends zeros and a flag, so ranks issue the same collectives
        and one no rank had a gradient for keeps ``.grad`` as it was. HSDP with ``all_reduce=False``
        keeps partial sums for the next all-reduced reduction.
        """
        reductions = []
        settings = self.settings
        group = settings.reduce_process_group or self.process_group
        with grad_off():
            for reduction in self.reduce_plan():
                dtype, params = reduction.dtype, reduction.params
                rows, present = [], []
                for p in params:
                    grad = unsharded_grad(p)
                    p.had_gradient = grad is not None
                    present.append(p.had_gradient)
                    rows.append(padded_grad_rows(p, grad))
                    clear_unsharded_grad(p)
                grad = None  # ``rows`` alone refers to the gradients now; the reduce-scatter drops it
                all_present = all(present)
                rows.append(self._flag_rows(dtype, present, all_present))
                pre, post = divide_factors(dtype, self.world_size, self.dp_size, settings.gradient_divide_factor)
                accumulate_all = all_present or not self._reads_flags(group)
                self.order_check.check(REDUCE_SCATTER, reduction.row_bytes, group)
                reductions.append(
                    PendingReduce(params, rows, group, pre, post, all_reduce, accumulate_all, tuple(present))
                )
        return reductions

    def reduce_plan(self) -> list[Reduction]:
        """The group's reduce-scatters: one per reduce dtype of its trainable parameters."""
        if self._reduce_plan is None:
            by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
            for p in self.trainable:
                by_dtype.setdefault(p.layout.reduce_dtype, []).append(p)
            self._reduce_plan = [Reduction(dtype, tuple(params)) for dtype, params in by_dtype.items()]
        return self._reduce_plan

    def issue_reduce(self, reduce: PendingReduce) -> None:
        """Issue a reduce-scatter ``start_reduce`` prepared; its rows are dropped once copied into the table."""
        rows, reduce.rows = reduce.rows, []
        with grad_off(), labelled("reduce_scatter", self):  # copies the rows into one table, then issues
            work, reduced = reduce_scatter_rows(
                rows, reduce.process_group, self.stats, reduce.pre_divide, self.settings.reduce_scatter
            )
        finish = partial(self._finish_reduce, reduce, reduced)
        pending = PendingCollective(work, finish, name=lambda: f"the reduce-scatter of {self.label}")
        self.pending_reduces.append(pending)

    def _flag_rows(self, dtype: torch.dtype, present: list[bool], all_present: bool) -> torch.Tensor:
        """This rank's has-gradient flags as the flag columns of every rank's row (all-present is cached)."""
        cached = self._all_present.get(dtype) if all_present else None
        if cached is not None:
            return cached
        # non-blocking: no stream sync on a GPU
        flags = torch.tensor(present, dtype=dtype).to(self.device, non_blocking=True).expand(self.world_size, -1)
        if all_present:
            self._all_present[dtype] = flags
        return flags

    def _finish_reduce(self, reduce: PendingReduce, reduced: torch.Tensor) -> None:
        """Add this rank's reduced rows into each parameter's sharded ``.grad`` (after the HSDP all-reduce)."""
        params, divide = reduce.params, reduce.post_divide
        if self.replicate_group is not None:
            earlier = self._partial.pop(reduced.dtype, None)
            if earlier is not None:
                reduced.add_(earlier)
            if not reduce.all_reduce:
                self._partial[reduced.dtype] = reduced
                return
            with labelled("all_reduce", self):
                self.order_check.check(ALL_REDUCE, reduced.numel() * reduced.element_size(), self.replicate_group)
                all_reduce_sum(reduced, self.replicate_group, self.stats)
        if reduce.accumulate_all:
            received = None
        elif is_fake(reduced):  # a fake step (estimate) has no sums to read: every rank is taken to be this one
            received = reduce.present
        else:
            received = reduced[-len(params) :].tolist()
        if self.settings.all_reduce_hook is not None:  # e.g. a user's all-reduce across replicas
            self.settings.all_reduce_hook(reduced[: -len(params)])
        if divide != 1:
            reduced.div_(self._divisor(divide, reduced.dtype))
        offset = reduced.storage_offset()
        for i, p in enumerate(params):
            rows = p.row_layout
            if received is None or received[i] > 0:  # this rank's rows, shaped (one view op)
                accumulate_grad(p, reduced.as_strided(rows.comm_local_shape, rows.comm_local_strides, offset))
            offset += rows.padded_numel

    def _on_gloo(self, group) -> bool:
        """Whether ``group`` (``None``: the default one) is gloo's, looked up once per group."""
        found = self._gloo.get(group)
        if found is None:
            found = self._gloo[group] = dist.get_backend(group) == "gloo"
        return found

    def _reads_flags(self, group) -> bool:
        """Whether reductions on ``group`` read the has-gradient flags back: on gloo only."""
        return group is None or self._on_gloo(group)

    def _frees_gathered(self, group, gathered: torch.Tensor) -> bool:
        """Whether the copy-out frees the all-gather's buffer itself: a CPU buffer of ours on gloo (``copy_out``).
        Elsewhere its last reference frees it: the caching allocator's stream order needs that on a device."""
        return self._on_gloo(group) and gathered.device.type == "cpu" and self.settings.all_gather is DIRECT_ALL_GATHER

    def _divisor(self, value: float, dtype: torch.dtype) -> float | torch.Tensor:
        """``value`` as a cached 0-dim fp32 CPU tensor for fp32 gradients (same kernel path, bit-identical,
        no new tensor per call), else as it is. Per group: a fake mode's tensor must not reach another model."""
        if dtype != torch.float32:
            return value
        divisor = self._divisors.get(value)
        if divisor is None:
            divisor = self._divisors[value] = torch.tensor(value, dtype=torch.float32, device="cpu")
        return divisor

    def wait_reduces(self, discard: bool = False) -> None:
        """Finish the reductions in flight; ``discard`` (a failed step): without adding their results."""
        pending, self.pending_reduces = self.pending_reduces, []
        for collective in pending:
            if discard:
                collective.on_done = _discard
            with labelled("wait", self):
                collective.finish()

    def discard_step(self) -> None:
        """After a failed step: finish in-flight collectives, drop their and accumulated gradients, reshard."""
        self.wait_unshard()
        self.wait_reduces(discard=True)
        self._partial.clear()
        self.order_check.collective_logs.forget()
        self.reshard()  # drops a kept post-forward slice too
        for p in self.params:
            clear_unsharded_grad(p)


def _discard() -> None:
    """Completion of a reduction whose result a recovered step no longer wants."""
