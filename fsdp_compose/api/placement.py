"""``shard_placement_fn``: parameters sharded on a dim other than 0, uneven sizes included, or on
a mesh of their own (``ShardPlacementResult``: experts over their expert-data-parallel mesh).

Each rank holds its ``torch.chunk`` of dim ``d``; collectives move ``d`` to the front (``_runtime/rows.py``:
``RowLayout``; ``_runtime/storage.py``: ``Staged``: copy-in sends the shard transposed, copy-out lands in a
staging buffer copied once into the contiguous parameter, gradients go and come back the same way), so
unevenness is plain dim-0 padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to put a parameter on a mesh of its own, as in torch's FSDP2.

    ``placement``: ``Shard(d)``, or ``None`` for ``Shard(0)``. ``mesh_info``: a ``DeviceMesh`` (1-D to
    shard, 2-D ``(replicate, shard)`` for HSDP), or torch's ``FSDPMeshInfo``/``HSDPMeshInfo`` (read by
    their ``mesh``, ``shard_mesh_dim`` and ``replicate_mesh_dim`` fields). A call's parameters on one
    mesh form one group, with its own all-gather and reduce-scatter.
    """

    placement: Shard | None
    mesh_info: Any


def resolve_placement(
    placement_fn: Callable[[nn.Parameter], Any] | None, param: nn.Parameter, fqn: str, module: str
) -> tuple[int, DeviceMesh | None]:
    """The (non-negative) dim ``placement_fn`` shards ``param`` on (``None`` means dim 0), and the mesh a
    ``ShardPlacementResult`` names (``None``: the call's mesh)."""
    if placement_fn is None:
        return 0, None
    placement, mesh = placement_fn(param), None
    if hasattr(placement, "mesh_info") and hasattr(placement, "placement"):  # ours or torch's
        placement, mesh = placement.placement, _mesh_of(placement.mesh_info, fqn, module)
    if placement is None:
        return 0, mesh
    if type(placement) is not Shard:  # _StridedShard and friends are not a choice a user makes here
        raise ValueError(
            f"fully_shard({module}, shard_placement_fn=...): returned {placement!r} for parameter "
            f"'{fqn}'; return Shard(dim), None (for Shard(0)) or ShardPlacementResult(placement, mesh_info)"
        )
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise ValueError(
            f"fully_shard({module}, shard_placement_fn=...): Shard({placement.dim}) for parameter "
            f"'{fqn}' of shape {tuple(param.shape)} is out of range; pick a dim in [{-ndim}, {ndim - 1}]"
        )
    return placement.dim % ndim, mesh


def _mesh_of(mesh_info: Any, fqn: str, module: str) -> DeviceMesh:
    """The data-parallel mesh a placement result names: 1-D (shard) or 2-D (replicate, shard)."""
    if isinstance(mesh_info, DeviceMesh):
        return mesh_info
    mesh = getattr(mesh_info, "mesh", None)
    shard, replicate = getattr(mesh_info, "shard_mesh_dim", None), getattr(mesh_info, "replicate_mesh_dim", None)
    where = f"fully_shard({module}, shard_placement_fn=...): the mesh_info for parameter '{fqn}'"
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where} is {mesh_info!r}; pass a DeviceMesh or torch's FSDPMeshInfo/HSDPMeshInfo")
    if getattr(mesh_info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(f"{where} names dp_mesh_dims; a per-parameter mesh takes a data-parallel mesh")
    if shard is None:
        raise ValueError(f"{where} has no shard dim (replicate only); fully_shard shards every parameter it manages")
    if (replicate is None and mesh.ndim == 1) or (mesh.ndim == 2 and (replicate, shard) == (0, 1)):  # 1-D, or HSDP
        return mesh
    if replicate is None and mesh.mesh_dim_names is not None:  # shard over one dim of a larger mesh
        return mesh[mesh.mesh_dim_names[shard]]
    raise ValueError(
        f"{where} has a {mesh.ndim}-D mesh with shard dim {shard} and replicate dim {replicate}; pass a 1-D "
        "mesh, a 2-D mesh with replicate dim 0 and shard dim 1 (HSDP), or a mesh with dim names"
    )
