"""Resolve the data-parallel mesh and device for a ``fully_shard`` call."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_default_meshes: dict[str, DeviceMesh] = {}


def default_device_type() -> str:
    """The accelerator torch would use, else CPU (gloo)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        device = accelerator.current_accelerator()
        if device is not None:
            return device.type
    return "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world, made once per device type."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized "
            "(torch.distributed.init_process_group) or an explicit mesh="
        )
    device_type = default_device_type()
    mesh = _default_meshes.get(device_type)
    if mesh is None or mesh.get_group() is None or dist.get_world_size() != mesh.size():
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        _default_meshes[device_type] = mesh
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device that parameters of this mesh should live on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


_post_forward_groups: dict[tuple, dist.ProcessGroup] = {}


def post_forward_group(mesh: DeviceMesh, ranks: int) -> dist.ProcessGroup:
    """This rank's group of ``ranks`` consecutive members of its shard group.

    Every rank must create every subgroup in the same order, so all blocks of all shard
    groups of the mesh are enumerated; they are made once per (mesh, size).
    """
    shard_size = mesh.size(mesh.ndim - 1)
    all_ranks = mesh.mesh.reshape(-1, shard_size).tolist()
    key = (tuple(map(tuple, all_ranks)), ranks)
    if key not in _post_forward_groups:
        blocks = [row[i : i + ranks] for row in all_ranks for i in range(0, shard_size, ranks)]
        group, _ = dist.new_subgroups_by_enumeration(blocks)
        _post_forward_groups[key] = group
    return _post_forward_groups[key]
