"""``dp_mesh_dims``: ``fully_shard`` on a full SPMD mesh whose parameters are already DTensors.

With e.g. ``mesh`` of dims ``("dp_replicate", "dp_shard", "tp")`` and parameters laid out on it
by tensor parallelism (``Replicate()`` on the data-parallel dims), ``DataParallelMeshDims`` names
which dims shard (flattened into one when several) and which replicate (HSDP). The group
communicates over a 1-D (shard) or 2-D (replicate, shard) mesh cut from the full one; each
shard stays a DTensor on the full mesh (or on the full mesh with the shard dims flattened).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from .._runtime.param_layout import dp_shard_placement


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class DataParallelMeshDims:
    """Which dims of a full SPMD ``DeviceMesh`` are data parallel (``fully_shard(dp_mesh_dims=...)``).

    Attributes:
        shard: the mesh dim name(s) ``fully_shard`` shards parameters over; several names are
            flattened into one shard dim (in mesh order: they must be adjacent).
        replicate: the mesh dim name(s) gradients are all-reduced over (HSDP); several names
            are flattened into one.

    At least one must be set. Parameters must be DTensors on that mesh with ``Replicate()`` on
    every named dim.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: set shard, replicate or both (mesh dim names)")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """One mesh dim over ``names``: the dim itself, or the named dims flattened."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def _adjacent(mesh_names: tuple[str, ...], names: tuple[str, ...]) -> bool:
    indices = [mesh_names.index(n) for n in names]
    return indices == list(range(indices[0], indices[0] + len(indices)))


def data_parallel_mesh(module: str, mesh: DeviceMesh, dims: DataParallelMeshDims) -> DeviceMesh:
    """The mesh the group communicates over: ``(shard,)`` or ``(replicate, shard)``.

    Validates the names first: every error names the module and the mesh's dims.
    """
    prefix = f"fully_shard({module}, dp_mesh_dims={dims!r})"
    mesh_names = mesh.mesh_dim_names
    if mesh_names is None:
        raise ValueError(
            f"{prefix}: the mesh has no dim names; create it with init_device_mesh(..., mesh_dim_names=...)"
        )
    shard, replicate = dims.shard_names, dims.replicate_names
    for name in shard + replicate:
        if name not in mesh_names:
            raise ValueError(f"{prefix}: mesh dim '{name}' is not one of the mesh's dims {mesh_names}")
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"{prefix}: a mesh dim is named twice; each dim shards or replicates, not both")
    if not shard:
        raise NotImplementedError(
            f"{prefix}: replicate-only (DDP) meshes are not supported; name at least one shard dim"
        )
    for names in (shard, replicate):
        if len(names) > 1 and not _adjacent(mesh_names, names):
            raise ValueError(f"{prefix}: dims {names} are flattened into one, so they must be adjacent in {mesh_names}")
    shard_mesh = _submesh(mesh, shard)
    if not replicate:
        return shard_mesh
    return DeviceMesh._concatenate([_submesh(mesh, replicate), shard_mesh])


def data_parallel_dims(mesh: DeviceMesh, dims: DataParallelMeshDims) -> frozenset[int]:
    """Indices of the named data-parallel dims in the full mesh."""
    return frozenset(mesh.mesh_dim_names.index(n) for n in dims.shard_names + dims.replicate_names)


def spmd_shard_layout(
    module: str, mesh: DeviceMesh, dims: DataParallelMeshDims, dp_mesh: DeviceMesh, param, fqn: str, dim: int
) -> tuple[DeviceMesh, list[Placement]]:
    """The mesh and placements of ``param``'s shard: its own, with the shard dim(s) now splitting ``dim``.

    The TP-local tensor is split again over the (flattened) shard dim. Tensor-parallel dims
    after it that split the same tensor dim chunk first, which ``_StridedShard`` expresses.
    """
    prefix = f"fully_shard({module}, dp_mesh_dims=...)"
    if not isinstance(param, DTensor):
        raise ValueError(
            f"{prefix}: parameter '{fqn}' is a plain tensor; with dp_mesh_dims every parameter must be a "
            "DTensor on the full mesh (e.g. from parallelize_module or distribute_tensor with Replicate() "
            "on the data-parallel dims)"
        )
    if param.device_mesh != mesh:
        raise ValueError(
            f"{prefix}: parameter '{fqn}' is a DTensor on mesh {param.device_mesh.mesh_dim_names}, not on the "
            f"mesh passed to fully_shard {mesh.mesh_dim_names}"
        )
    names = mesh.mesh_dim_names
    placements = list(param.placements)
    for name in dims.shard_names + dims.replicate_names:
        placement = placements[names.index(name)]
        if not isinstance(placement, Replicate):
            raise ValueError(
                f"{prefix}: parameter '{fqn}' has placement {placement} on data-parallel mesh dim '{name}'; "
                "expected Replicate()"
            )
    shard_idx = [names.index(n) for n in dims.shard_names]
    after = shard_idx[-1] + 1
    dp_placement = dp_shard_placement(dim, placements[after:], mesh.shape[after:])
    if len(shard_idx) == 1:
        placements[shard_idx[0]] = dp_placement
        return mesh, placements
    # several shard dims: describe the shard on the mesh with those dims flattened into one
    flat = dp_mesh[dp_mesh.mesh_dim_names[-1]] if dp_mesh.ndim == 2 else dp_mesh
    first = shard_idx[0]
    submeshes = [mesh[n] for n in names[:first]] + [flat] + [mesh[n] for n in names[after:]]
    return DeviceMesh._concatenate(submeshes), placements[:first] + [dp_placement] + placements[after:]
