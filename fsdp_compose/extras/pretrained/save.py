"""``save_pretrained``: a sharded model written as a Hugging Face checkpoint, no rank gathering the model.

Where every rank sees the same directory (a shared filesystem, the usual case), rank 0 creates each file at
its full size with its header, and after one barrier every rank writes its own rows at their byte offsets
(``os.pwrite``): no collective moves any tensor data, and one replica of each row writes it (HSDP, tensor
parallel replicas). Where the ranks see different directories (node-local disks), rank 0 writes every file
and receives each tensor whole, one at a time (``DTensor.full_tensor``): the directory appears on rank 0's
disk, and each rank holds at most one full tensor beyond its shards.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...extras_api import reshard_idle, user_class

from . import peft
from .agreement import raise_on_every_rank
from .checkpoint_dir import INDEX_NAME, SINGLE_NAME
from .local_region import region_of
from .model_tensors import ModelTensor, checkpoint_tensors
from .progress import progress
from .safetensors_file import NAMES, PretrainedCheckpointError, header_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@torch.no_grad()
def save_pretrained(
    model: nn.Module,
    path: str,
    *,
    max_shard_size: int | str = "5GB",
    shared_filesystem: bool | None = None,
    merge_adapters: bool = False,
) -> list[str]:
    """Write ``model`` (sharded or not) to the directory ``path`` as ``transformers.from_pretrained`` reads it:
    safetensors files of at most ``max_shard_size`` each (``model.safetensors``, or numbered files and
    ``model.safetensors.index.json``), with the model's ``config.json`` and ``generation_config.json`` when
    it has them. Values are written in the parameters' dtype, bit for bit. Call it on every rank.

    A peft ``PeftModel`` is written as ``PeftModel.save_pretrained`` writes it: each adapter's
    ``adapter_model.safetensors`` (peft's names) and ``adapter_config.json``, no base weights; with
    ``merge_adapters=True``, the base model with the active LoRA adapters merged into its weights instead.

    ``shared_filesystem`` (default: found out by a file rank 0 writes and every rank looks for) chooses the
    way: every rank writing its rows in place, or rank 0 writing everything. Returns the files written.
    """
    reshard_idle(model, "save_pretrained")  # the modules hold the shards again (a forward without backward)
    tensors = checkpoint_tensors(model)
    for target in tensors:
        if target.tensor.is_meta:
            raise ValueError(f"save_pretrained: '{target.names[0]}' is on meta; it has no values to save")
        if target.tensor.dtype not in NAMES:
            raise ValueError(f"save_pretrained: '{target.names[0]}' has dtype {target.tensor.dtype}, which safetensors cannot hold")
    if merge_adapters and not peft.holds_adapters(model):
        raise ValueError("save_pretrained(merge_adapters=True): the model holds no peft adapters")
    if peft.holds_adapters(model) and not merge_adapters:
        written = []
        for folder, members in peft.adapter_files(model, tensors):  # every check before the first write
            out = os.path.join(path, folder)
            written += _write_files(out, members, None, shared_filesystem, peft.ADAPTER_FILE)[0]
        _on_rank0(lambda: peft.write_adapter_configs(model, path))
        return written
    if merge_adapters:
        tensors = peft.merged_tensors(model, peft.split(model, tensors)[0])
    written, files, total = _write_files(path, tensors, _bytes(max_shard_size), shared_filesystem, SINGLE_NAME)
    names = [os.path.basename(file) for file in written]
    _on_rank0(lambda: _write_small_files(path, names, files, total, peft.base_model(model)))
    return written


def _write_files(
    path: str, tensors: list[ModelTensor], limit: int | None, shared_filesystem: bool | None, single_name: str
) -> tuple[list[str], list[list[ModelTensor]], int]:
    """``tensors`` written into ``path`` in files of at most ``limit`` bytes (one file: ``single_name``);
    the files' paths, their members and the bytes of tensor data."""
    files = _split(tensors, limit) if limit is not None else [tensors]
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(path, exist_ok=True)
    if shared_filesystem is None:
        shared_filesystem = _shared(path)
    numbered = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    names = [single_name] if len(files) == 1 else numbered
    total = sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in tensors)
    with progress(total, "save_pretrained") as bar:
        for name, members in zip(names, files):
            header, offsets = header_bytes(
                [(t.names[0], t.tensor.dtype, tuple(t.tensor.shape)) for t in members], {"format": "pt"}
            )
            file = os.path.join(path, name)
            if shared_filesystem:
                _write_rows(file, header, offsets, members, rank)
            else:
                _write_whole(file, header, offsets, members, rank)
            bar.update(sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in members))
    return [os.path.join(path, name) for name in names], files, total


def _write_small_files(
    path: str, names: list[str], files: list[list[ModelTensor]], total: int, model: nn.Module
) -> None:
    """The index (for several files) and the configuration files."""
    if len(files) > 1:
        _write_index(path, names, files, total)
    _write_configs(model, path)


def _on_rank0(write: Callable[[], object]) -> None:
    """Rank 0 writes the small files; its error, if any, is raised on every rank (the others wait for it)."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write()
        except Exception as failure:  # noqa: BLE001 - passed to every rank, raised there
            error = f"save_pretrained: writing the configuration files failed: {type(failure).__name__}: {failure}"
    raise_on_every_rank(error)


def _write_rows(file: str, header: bytes, offsets: dict[str, int], members: list[ModelTensor], rank: int) -> None:
    if rank == 0:
        size = len(header) + sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in members)
        with open(file, "wb") as f:
            f.write(header)
            f.truncate(size)
    _barrier()
    fd = os.open(file, os.O_WRONLY)
    try:
        for target in members:
            tensor = target.tensor
            region = region_of(tensor, target.names[0])
            if not region.writer or (not isinstance(tensor, DTensor) and rank != 0):
                continue
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            data = local.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
            for in_tensor, in_local, n in region.runs(tensor.dtype.itemsize):
                _pwrite_all(fd, memoryview(data)[in_local : in_local + n], offsets[target.names[0]] + in_tensor)
        os.fsync(fd)
    finally:
        os.close(fd)
    _barrier()


def _write_whole(file: str, header: bytes, offsets: dict[str, int], members: list[ModelTensor], rank: int) -> None:
    """Rank 0 writes the file; each tensor is gathered whole, one at a time (every rank takes part)."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if rank == 0 else None
    try:
        if fd is not None:
            _pwrite_all(fd, memoryview(header), 0)
        for target in members:
            tensor = target.tensor
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if fd is not None:
                data = full.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
                _pwrite_all(fd, memoryview(data), offsets[target.names[0]])
            del full
        if fd is not None:
            os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _split(tensors: list[ModelTensor], limit: int) -> list[list[ModelTensor]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (a larger tensor alone in its file)."""
    files: list[list[ModelTensor]] = [[]]
    size = 0
    for target in tensors:
        nbytes = target.tensor.numel() * target.tensor.dtype.itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(target)
        size += nbytes
    return files


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if not match:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _shared(path: str) -> bool:
    """Whether every rank sees the file rank 0 writes in ``path`` (one object broadcast, one all-gather)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = os.path.join(path, f".fsdp_compose_probe_{token[0]}")
    if dist.get_rank() == 0:
        with open(probe, "w") as f:
            f.write(token[0])
    dist.barrier()
    try:
        with open(probe) as f:
            sees = f.read() == token[0]
    except OSError:
        sees = False
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, sees)
    if dist.get_rank() == 0:
        os.remove(probe)
    return all(answers)


def _write_index(path: str, names: list[str], files: list[list[ModelTensor]], total: int) -> None:
    weight_map = {t.names[0]: name for name, members in zip(names, files) for t in members}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def _write_configs(model: nn.Module, path: str) -> None:
    """A Hugging Face model's ``config.json`` (naming its own class, not ours) and ``generation_config.json``."""
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config = copy.deepcopy(config)
        config.architectures = [user_class(type(model)).__name__]
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
        if floating:  # transformers reloads in this dtype (its own save_pretrained records it too)
            config.dtype = floating[0]
        config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(path)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
