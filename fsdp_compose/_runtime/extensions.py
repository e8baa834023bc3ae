"""torch FSDP2's all-gather extension protocol: a shard that decides what travels.

A local shard defining ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's float8 and
NF4 weights) chooses its all-gather inputs, any tensors plus metadata. They travel as bytes in the
group's one all-gather into outputs kept across steps; post-all-gather builds the unsharded
parameter from them once, then refreshes it (``out=``). Reshard frees the outputs and what
post-all-gather named. Gradients stay plain tensors, reduced like any other.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .param_layout import contiguous_strides
from .storage import Aliased, give_storage

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
CODEC_ATTR = "_fsdp_compose_wire"


def set_gather_codec(param: torch.Tensor, codec: Any) -> None:
    """Send ``param`` through ``codec`` in place of its shard's own bytes (before ``fully_shard``): the one entry
    for a codec of this protocol (the quantize extra's ``BlockQuantized``). A codec has the protocol's ``pre`` and
    ``post`` (taking the shard first), ``rebuilds(param_dtype)``, ``requantize_into(data, scales, weight, meta)`` and
    ``wire_nbytes(padded_numel)`` (what ``pre`` will send, for ``explain`` before the first gather)."""
    setattr(param, CODEC_ATTR, codec)


def gather_codec_of(param: torch.Tensor) -> Any | None:
    """The codec ``set_gather_codec`` gave ``param`` (an attribute: see ``register_owner``), else ``None``."""
    return getattr(param, CODEC_ATTR, None)


def has_protocol(tensor: torch.Tensor, where: str) -> bool:
    """Whether ``tensor`` implements the protocol; one method without the other is an error."""
    pre, post = hasattr(tensor, PRE), hasattr(tensor, POST)
    if pre != post:
        have, missing = (PRE, POST) if pre else (POST, PRE)
        raise ValueError(
            f"{where} is a {type(tensor).__name__} that defines {have} but not {missing}; "
            "the all-gather extension protocol needs both"
        )
    return pre


def _mode_tensor_types() -> tuple[type, ...]:
    """Tensors a dispatch mode makes of plain ones (``FakeTensorMode``'s, functionalization's): they stand
    for plain tensors, so they are sharded and gathered as plain ones. Private names: found once, else none."""
    found = []
    for module, name in (("fake_tensor", "FakeTensor"), ("functional_tensor", "FunctionalTensor")):
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(__import__(f"torch._subclasses.{module}", fromlist=[name]), name))
    return tuple(found)


MODE_TENSORS = _mode_tensor_types()


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """A tensor subclass that intercepts operators (``__torch_dispatch__``): its bytes are not its values."""
    return torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python) and not isinstance(tensor, MODE_TENSORS)


class GatherExtension:
    """The unsharded form (``unsharded.py``) of a shard with the protocol, or a codec, for the local shard
    ``source`` of ``p`` (a ``ShardedParam``): its pre-all-gather chooses the inputs, the group's columns, its
    post-all-gather builds the parameter from persistent outputs; reshard frees them and what it named."""

    def __init__(self, p, source: torch.Tensor, codec=None) -> None:
        self.source = source
        self.row_layout, self.layout = p.row_layout, p.layout
        # a codec (``set_gather_codec``) in place of the shard's own methods
        self.codec = codec
        self.fqn = p.fqn
        # what pre-all-gather is called with: the shard mesh (1-D, as FSDP2 passes it), and in the five-argument
        # form the unsharded size and contiguous stride, the module and the mixed-precision policy
        mesh = p.mesh if p.mesh.ndim == 1 else p.mesh[p.mesh.mesh_dim_names[-1]]
        outer = p.row_layout.shape
        five = codec is not None or _arity(source, p.fqn) == 5
        self.pre_args = (mesh, outer, contiguous_strides(outer), p.places[0].module, p.mp_policy) if five else (mesh,)
        self.shapes: list[torch.Size] | None = None  # padded per-rank input shapes
        self.dtypes: list[torch.dtype] = []
        self._widths: list[int] = []  # bytes per rank of each input: the group's columns
        # kept until the next pre-all-gather: after a forward with reshard_after_forward=<int> the
        # backward re-gathers the same inputs within fewer ranks, and post-all-gather needs it again
        self.metadata: Any = None
        self.outputs: list[torch.Tensor] = []  # flat (world * numel) per input, storage freed when sharded
        self.freed: list[tuple[torch.UntypedStorage, int]] = []  # other storages post-all-gather returned
        # a codec's dequantized weight while its 1-byte values are freed: ``targets`` rebuilds them from it
        self._rebuild_from: torch.Tensor | None = None
        self._pads: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def extension(self) -> GatherExtension:
        """The protocol's state: this form itself (the other forms have ``None``)."""
        return self

    rows = Aliased.rows  # the copy-out targets, given storage

    def widths(self) -> list[int]:
        return self._widths

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Call pre-all-gather; return this rank's byte pieces (inputs laid out like the shard's rows are
        padded with zero rows to the padded count, so uneven shards need no self-padding subclass)."""
        self._rebuild_from = None  # a new gather: its copy-out fills the outputs
        if local.device != self.layout.compute_device:  # CPU offload: the shard goes to the compute device first
            local = local.to(self.layout.compute_device, non_blocking=True)
        pre = getattr(local, PRE) if self.codec is None else partial(self.codec.pre, local)
        inputs, self.metadata = pre(*self.pre_args)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        pieces, shapes, rows = [], [], self.row_layout  # the protocol is refused on Shard(d > 0): rows are dim 0
        for t in inputs:
            shape = t.shape
            pieces.append(t.contiguous().view(-1).view(torch.uint8))
            # laid out like this rank's rows and short of the padded count: pad it (a codec pads itself)
            short = len(shape) and shape[0] == rows.local_rows < rows.rows_per_rank and shape[1:] == rows.shape[1:]
            if short and self.codec is None:
                row_bytes = math.prod(shape[1:]) * t.dtype.itemsize
                pieces.append(self._zeros((rows.rows_per_rank - rows.local_rows) * row_bytes, t.device))
                shape = torch.Size((rows.rows_per_rank, *shape[1:]))
            shapes.append(shape)
        dtypes = [t.dtype for t in inputs]
        if self.shapes is None:
            self.shapes, self.dtypes = shapes, dtypes
            self._widths = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        elif shapes != self.shapes or dtypes != self.dtypes:
            raise ValueError(
                f"parameter '{self.fqn}': {PRE} returned inputs of shapes {_listing(shapes, dtypes)} after "
                f"{_listing(self.shapes, self.dtypes)} on an earlier step; they must stay the same"
            )
        return pieces

    def _zeros(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Zero bytes that pad a short input, made once (they are only read)."""
        pad = self._pads.get((nbytes, device))
        if pad is None:
            pad = self._pads[(nbytes, device)] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return pad

    def targets(self, p) -> list[torch.Tensor]:
        """Give the outputs storage; return (world, width) byte views with their own version counters (see
        [Note: the aliasing copy-out target] in ``param_layout.py``)."""
        world, device = self.row_layout.world, self.layout.compute_device
        if not self.outputs:
            self.outputs = [
                torch.empty(world * math.prod(s), dtype=d, device=device) for s, d in zip(self.shapes, self.dtypes)
            ]
        views = []
        for out, width in zip(self.outputs, self._widths):
            storage = out.untyped_storage()
            give_storage(storage, world * width)
            views.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (world, width), (width, 1)))
        if self._rebuild_from is not None:  # read while unsharded: a post-forward slice is cut from them
            data, scales = self.outputs
            with torch.no_grad():
                self.codec.requantize_into(data, scales, self._rebuild_from, self.metadata)
        return views

    def finish(self, p, slice_follows: bool) -> None:
        """Post-all-gather builds the unsharded parameter (first unshard) or refreshes it in place
        (``slice_follows``: a ``reshard_after_forward=<int>`` slice is cut from what was gathered)."""
        outputs = tuple(out.view(-1, *s[1:]) for out, s in zip(self.outputs, self.shapes))
        post = getattr(self.source, POST) if self.codec is None else self.codec.post
        param_dtype, unsharded = self.layout.gather_dtype, p.unsharded_param
        if unsharded is not None:
            # storage for what post-all-gather refreshes, given here: parameters are posted one at a
            # time, so one's outputs are freed before the next one's tensors take their room
            for storage, nbytes in self.freed:
                give_storage(storage, nbytes)
            post(outputs, self.metadata, param_dtype, out=unsharded)
        else:
            result = post(outputs, self.metadata, param_dtype)
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
                raise ValueError(
                    f"parameter '{self.fqn}': {POST} must return (unsharded tensor, tensors to free on reshard) "
                    f"when called without out=, got {type(result).__name__}"
                )
            unsharded, to_free = result
            known = {out.untyped_storage()._cdata for out in self.outputs}  # each storage freed once
            for storage in (t.untyped_storage() for t in to_free if not is_wrapper_subclass(t)):
                if storage._cdata not in known:
                    known.add(storage._cdata)
                    self.freed.append((storage, storage.nbytes()))
            shape = self.row_layout.shape
            p.new_unsharded(torch.as_strided(unsharded, shape, contiguous_strides(shape), 0))
        self._release_after_post(unsharded, param_dtype, slice_follows)

    def _release_after_post(self, weight: torch.Tensor, param_dtype: torch.dtype, slice_follows: bool) -> None:
        """Free a codec's gathered bytes once dequantized into ``weight`` (kept, they would sit beside it
        until reshard). Where a post-forward slice may be cut from them (``slice_follows``) the scales
        stay and ``targets`` gets the values back from ``weight``."""
        if self.codec is None:
            return
        if not slice_follows:
            for out in self.outputs:
                out.untyped_storage().resize_(0)
        elif self.codec.rebuilds(param_dtype):
            self.outputs[0].untyped_storage().resize_(0)
            self._rebuild_from = weight

    def free(self) -> None:
        self._rebuild_from = None
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        for storage, _ in self.freed:
            storage.resize_(0)

    def nbytes(self) -> int:
        return sum(out.untyped_storage().nbytes() for out in self.outputs) + sum(s.nbytes() for s, _ in self.freed)


def _arity(tensor: torch.Tensor, fqn: str) -> int:
    count = len(inspect.signature(getattr(tensor, PRE)).parameters)
    if count not in (1, 5):
        raise ValueError(
            f"parameter '{fqn}': {PRE} takes {count} arguments; it must take (mesh) or "
            "(mesh, outer_size, outer_stride, module, mp_policy)"
        )
    return count


def _listing(shapes, dtypes) -> str:
    return ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in zip(shapes, dtypes))


def refuse_without_protocol(local: torch.Tensor, fqn: str) -> None:
    """A tensor subclass whose shard reaches an all-gather without the protocol: its bytes are not its
    values. Checked there, not at ``fully_shard``: torch lets the protocol be attached in between."""
    if is_wrapper_subclass(local) and not isinstance(local, DTensor):
        raise ValueError(
            f"parameter '{fqn}' is a tensor subclass ({type(local).__name__}) without fsdp_pre_all_gather and "
            "fsdp_post_all_gather; fully_shard gathers parameters as bytes, which would not be its values. "
            "Implement the all-gather extension protocol on it, or pass it in ignored_params"
        )


def check_subclass(source: torch.Tensor, fqn: str, tensor_parallel: bool, shard_dim: int, wire: bool = False) -> None:
    """Refuse the protocol (or a quantized wire format) where its layout is undefined (tensor parallel,
    ``Shard(d)`` with ``d > 0``)."""
    protocol = has_protocol(source, f"parameter '{fqn}'")
    if (protocol or wire) and (tensor_parallel or shard_dim):
        layout = "tensor parallel" if tensor_parallel else f"Shard({shard_dim})"
        what = "implements the all-gather extension protocol" if protocol else "has a quantized all-gather"
        raise NotImplementedError(
            f"parameter '{fqn}' {what}, which fully_shard supports on dim-0 shards of a data-parallel mesh only, "
            f"not with {layout}"
        )


def shard_subclass(full: torch.Tensor, p) -> torch.Tensor:
    """``p``'s (a ``ShardedParam``'s) ``torch.chunk`` of a tensor subclass copied into ``new_zeros`` (FSDP2's
    operators, all NF4 has), moved where shards live (a meta shard, before ``to_empty``, keeps ``full``'s device)."""
    try:
        rows = p.row_layout
        chunks = torch.chunk(full.detach(), rows.world, dim=rows.shard_dim)
        piece = chunks[rows.rank] if rows.rank < len(chunks) else None
        local = full.new_zeros(rows.local_shape) if piece is None else piece.new_zeros(piece.shape)
        if piece is not None:
            local.copy_(piece)
        device = p.layout.storage_device
        if local.device != device and device.type != "meta":
            local = local.to(device)
    except Exception as error:  # noqa: BLE001 - any operator the subclass lacks
        raise ValueError(
            f"parameter '{p.fqn}' is a {type(full).__name__}, which cannot be sharded: "
            f"{type(error).__name__}: {error}. Sharding a tensor subclass needs torch.chunk on dim "
            f"{p.row_layout.shard_dim}, new_zeros and copy_ (as in torch's FSDP2); pass it in ignored_params "
            "to leave it unsharded"
        ) from error
    return local
