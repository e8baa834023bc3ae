"""One managed parameter: its shard as a DTensor and its reusable unsharded tensor.

The unsharded ``nn.Parameter`` is one object whose storage is allocated on unshard and freed on
reshard, so autograd's saved references to it see fresh data after a re-unshard in backward.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from .extensions import (
    GatherExtension,
    check_subclass,
    gather_codec_of,
    has_protocol,
    is_wrapper_subclass,
    refuse_without_protocol,
    shard_subclass,
)
from .param_layout import ParamLayout, ParamPlace, contiguous_strides, spmd_layout
from .rows import row_layout
from .storage import Aliased, Staged


class ShardedParam:
    """This rank's rows of one parameter (``row_layout``: which rows, and how collectives pad them), and the
    means to rebuild it."""

    def __init__(
        self,
        param: nn.Parameter,
        places: list[ParamPlace],
        fqn: str,
        mesh: DeviceMesh,
        layout: ParamLayout,
        shard_dim: int = 0,
        spmd: tuple[DeviceMesh, list[Placement]] | None = None,
        dp_dims: frozenset[int] = frozenset(),
        mp_policy=None,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the 0-dim parameter '{fqn}' on dim 0; "
                "give it shape (1,) or pass it in ignored_params"
            )
        self.fqn = fqn
        self.places = places
        self.mesh = mesh
        self.layout = layout
        # tensor parallel: the TP-local tensor is what gets sharded and gathered here
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        # mesh dims of ``tp_spec`` that are data parallel (``dp_mesh_dims``): gradients keep their layout there
        self.dp_dims = dp_dims
        source = param._local_tensor if self.tp_spec is not None else param
        spmd_mesh, placements = spmd or spmd_layout(mesh, param, fqn, shard_dim)
        # the last mesh dim shards; a leading (HSDP) dim replicates. Rows are slices of ``shard_dim`` of what
        # the module sees (global, or TP-local under TP)
        world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
        self.row_layout = row_layout(source.shape, shard_dim, world, rank)
        self.shape = param.shape  # global shape
        self.dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.had_gradient: bool | None = None  # whether the last reduction had a gradient of it (explain reads it)
        self.mp_policy = mp_policy  # passed to the all-gather extension protocol's five-argument form
        # a codec from ``set_gather_codec`` (the quantize extra's wire format), sent through the same protocol
        self.wire = gather_codec_of(param)
        check_subclass(source, fqn, self.tp_spec is not None, shard_dim, self.wire is not None)
        local, stride = self.shard_of(param), contiguous_strides(self.shape)
        shard = DTensor.from_local(local, spmd_mesh, placements, run_check=False, shape=self.shape, stride=stride)
        self.sharded_param = nn.Parameter(shard, requires_grad=param.requires_grad)
        # called with the unsharded parameter after autograd accumulated its gradient
        self.on_grad_accumulated = None
        self._forget_built()

    def _forget_built(self) -> None:
        """Drop what was built for the shard and its gather dtype; the next unshard builds it anew."""
        self.unsharded_param: nn.Parameter | None = None
        # no-sync micro-batches: the unsharded gradient summed in the reduce dtype (``param_grad.stash_grad``)
        self.accumulated_grad: torch.Tensor | None = None
        # where the unsharded form lives: plain, staged, or the extension protocol's (``unsharded.py``)
        self.form: Aliased | Staged | GatherExtension = self._plain_form()
        self.plain_source: torch.Tensor | None = None  # a local shard known not to implement the protocol

    def _plain_form(self) -> Aliased | Staged:
        """The storage of the unsharded form for a shard without the extension protocol (``unsharded.py``)."""
        kind = Staged if self.row_layout.shard_dim else Aliased
        return kind(self.row_layout, self.layout)

    @property
    def extension(self) -> GatherExtension | None:
        """The all-gather extension protocol's state, for a local shard that implements it (``extensions.py``)."""
        return self.form.extension

    @torch.no_grad()
    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (the global value, or a TP parameter's DTensor), where shards
        live: the one way a full value becomes a shard (``fully_shard``, replaced parameters, loading,
        deferred init, summon). Meta shards (before ``to_empty``) take ``full``'s device."""
        if self.tp_spec is not None:
            if isinstance(full, DTensor):
                full = full._local_tensor
            else:
                tp_mesh, tp_placements = self.tp_spec.mesh, self.tp_spec.placements
                full = distribute_tensor(full.detach(), tp_mesh, tp_placements, src_data_rank=None)._local_tensor
        if not is_wrapper_subclass(full):
            return self.placed(self.row_layout.shard_of(full.detach()))
        local = shard_subclass(full, self)
        return local.pin_memory() if self.layout.pin_memory and local.device.type == "cpu" else local

    def placed(self, local: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``local`` where shards live (pinned under offload); meta shards (before
        ``to_empty``) keep ``local``'s device."""
        device = local.device if self.layout.storage_device.type == "meta" else self.layout.storage_device
        local = local.detach().to(device, memory_format=torch.contiguous_format, copy=True)  # one copy, on any device
        return local.pin_memory() if self.layout.pin_memory and local.device.type == "cpu" else local

    def as_shard(self, value: torch.Tensor) -> DTensor:
        """``value`` (a full tensor, or a DTensor of any layout) laid out like the shard: the one way
        loading and replacement turn a value into a shard. A DTensor laid out like it already is
        returned as is where its local tensor could be the shard; anything else becomes a copy."""
        target = self.sharded_param
        if isinstance(value, DTensor) and value.device_mesh == target.device_mesh:
            local, storage = value._local_tensor, self.layout.storage_device
            if tuple(value.placements) == tuple(target.placements):
                ours = (storage.type == "meta" or local.device == storage) and local.shape == self.row_layout.local_shape
                if ours and local.is_contiguous():
                    return value
                local = self.placed(local)
            else:
                local = self.placed(value.redistribute(target.device_mesh, target.placements)._local_tensor)
        else:
            local = self.shard_of(value.full_tensor() if isinstance(value, DTensor) else value)
        return DTensor.from_local(
            local, target.device_mesh, target.placements, run_check=False, shape=self.shape, stride=target.stride()
        )

    # ----- sharded side -----------------------------------------------------------------
    def local_tensor(self) -> torch.Tensor:
        """The current local shard (the optimizer may have replaced the object)."""
        return self.sharded_param._local_tensor

    def refresh(self, sharded_param: nn.Parameter | None = None, layout: ParamLayout | None = None) -> torch.device:
        """Re-read the shard; return the device the unsharded parameter computes on.

        With ``sharded_param`` (laid out like the current shard, under ``layout``'s dtypes) it becomes
        the shard, registered where the parameter lives: the user replaced it or converted its dtype
        (``model.to(torch.float64)``). What was built for the old one is dropped and built anew by
        the next unshard; the group must be sharded (``_runtime/refresh.py``). Either way the layout
        follows the shard's device (``to_empty`` from meta)."""
        if sharded_param is not None:
            self.sharded_param = sharded_param
            self.dtype = sharded_param.dtype
            if self.tp_spec is not None and self.tp_spec.tensor_meta.dtype != self.dtype:
                # the unsharded TP DTensor is rebuilt from this spec: it must carry the new dtype
                meta = self.tp_spec.tensor_meta._replace(dtype=self.dtype)
                self.tp_spec = dataclasses.replace(self.tp_spec, tensor_meta=meta)
            self.requires_grad = sharded_param.requires_grad
            self.layout = layout
            self._forget_built()
            self.use(unsharded=False)
        device = self.local_tensor().device
        if self.layout.storage_device.type == "meta" and device.type != "meta":  # materialized by ``to_empty``
            if self.layout.offload and device.type != "cpu":
                raise ValueError(
                    f"parameter '{self.fqn}' was materialized on {device}, but offload_policy=CPUOffloadPolicy() keeps "
                    "shards on the CPU: call model.to_empty(device='cpu'); the group still computes on "
                    f"{self.layout.compute_device}"
                )
            self.layout = dataclasses.replace(self.layout, storage_device=device)
            if self.layout.pin_memory:  # as torch's FSDP2: the same parameter object, its local tensor pinned
                self.sharded_param._local_tensor = self.local_tensor().pin_memory()
        return self.layout.compute_device

    def choose_form(self, local: torch.Tensor) -> None:
        """The protocol's form for ``local`` if it implements the protocol (checked once per shard object:
        ``to_empty`` or a replaced parameter brings a new one); else remembers ``local`` as plain."""
        own = has_protocol(local, f"the shard of parameter '{self.fqn}'")  # a subclass's protocol comes first
        protocol = own or self.wire is not None
        if self.form.extension is not None or (protocol and self.unsharded_param is not None):
            # the unsharded parameter was built for another shard object: build it anew
            self.form.free()
            self.unsharded_param, self.form = None, self._plain_form()
        if not protocol:
            refuse_without_protocol(local, self.fqn)
            self.plain_source = local
            return
        self.form = GatherExtension(self, local, None if own else self.wire)

    # ----- unsharded side ---------------------------------------------------------------
    def new_unsharded(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the unsharded parameter (the module's TP DTensor around it under tensor parallel)."""
        if self.tp_spec is not None:
            tensor = DTensor(tensor, self.tp_spec, requires_grad=self.requires_grad)
        self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)
        if self.requires_grad and self.on_grad_accumulated is not None:
            self.unsharded_param.register_post_accumulate_grad_hook(self.on_grad_accumulated)

    def gather_pieces(self) -> list[torch.Tensor]:
        """This rank's all-gather contribution as byte pieces, moved and cast to the gather dtype before the
        collective (bf16 halves the bytes moved); a shard object not seen before picks its form first."""
        local = self.sharded_param._local_tensor
        extension = self.form.extension
        if local is not self.plain_source and (extension is None or extension.source is not local):
            self.choose_form(local)
        return self.form.pieces(local)

    def use(self, unsharded: bool) -> None:
        """Register the sharded or the unsharded parameter everywhere it lives."""
        param = self.unsharded_param if unsharded else self.sharded_param
        for place in self.places:
            place.module._parameters[place.name] = param
