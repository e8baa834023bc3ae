"""Resolve the data-parallel mesh and device for a ``fully_shard`` call."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._runtime.uids import rank_key

_rank_caches: dict[tuple[int, int], tuple[object, object, dict]] = {}


def _rank_cache() -> dict:
    """Meshes and groups made for this rank in the current world, to reuse across calls.

    Per rank, not per process: under torch's threaded process group every rank is a thread
    of one process, and a mesh or subgroup made by one rank is wrong on another (a mesh
    remembers the rank and thread that made it; a subgroup is that rank's block). Emptied
    when the default process group is replaced, so nothing made for a destroyed world is
    reused, and when the active fake tensor mode changes (a mesh made under one holds its
    tensors, which another fake mode, or real code, cannot use).
    """
    world = dist.group.WORLD
    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    key = rank_key()
    entry = _rank_caches.get(key)
    if entry is None or entry[0] is not world or entry[1] is not fake_mode:
        entry = _rank_caches[key] = (world, fake_mode, {})
    return entry[2]


def default_device_type() -> str:
    """The accelerator torch would use, else CPU (gloo)."""
    if torch.accelerator.is_available():  # then current_accelerator() is that accelerator
        return torch.accelerator.current_accelerator().type
    return "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world, made once per device type."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized "
            "(torch.distributed.init_process_group) or an explicit mesh="
        )
    device_type = default_device_type()
    cache = _rank_cache()
    mesh = cache.get(device_type)
    if mesh is None or mesh.get_group() is None or dist.get_world_size() != mesh.size():
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        cache[device_type] = mesh
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device that parameters of this mesh should live on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    if torch.accelerator.is_available():
        return torch.device(mesh.device_type, torch.accelerator.current_device_index())
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def post_forward_group(mesh: DeviceMesh, ranks: int) -> dist.ProcessGroup:
    """This rank's group of ``ranks`` consecutive members of its shard group.

    Every rank must create every subgroup in the same order, so all blocks of all shard
    groups of the mesh are enumerated; they are made once per (mesh, size) on each rank.
    """
    shard_size = mesh.size(mesh.ndim - 1)
    all_ranks = mesh.mesh.reshape(-1, shard_size).tolist()
    key = ("post_forward", tuple(map(tuple, all_ranks)), ranks)
    cache = _rank_cache()
    if key not in cache:
        blocks = [row[i : i + ranks] for row in all_ranks for i in range(0, shard_size, ranks)]
        cache[key], _ = dist.new_subgroups_by_enumeration(blocks)
    return cache[key]
