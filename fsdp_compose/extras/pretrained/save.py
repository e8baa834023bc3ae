"""``save_pretrained``: a sharded model written as a Hugging Face checkpoint, no rank gathering the model.

Where every rank sees the same directory (a shared filesystem, the usual case), rank 0 creates each file at
its full size with its header, and after one barrier every rank writes its own rows at their byte offsets
(``os.pwrite``): no collective moves any tensor data, and one replica of each row writes it (HSDP, tensor
parallel replicas). Where the ranks see different directories (node-local disks), rank 0 writes every file
and receives each tensor whole, one at a time (``DTensor.full_tensor``): the directory appears on rank 0's
disk, and each rank holds at most one full tensor beyond its shards. Either way every file is written into a
fresh directory beside the target and put in its place only once every rank's writes succeeded
(``save_dir.py``): the target holds the old checkpoint or the new one, never a mix, a partial file, a stale
index, or a write through a link planted in it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...extras_api import reshard_idle, user_class

from . import peft
from .checkpoint_dir import INDEX_NAME, SINGLE_NAME
from .conversions import ConvertedTensor, to_checkpoint_layout
from .local_region import Region, region_of
from .model_tensors import ModelTensor, checkpoint_tensors
from .progress import progress_bar
from .safetensors_file import NAMES, header_bytes
from .save_dir import SaveDir, attempt, pwrite_all

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@torch.no_grad()
def save_pretrained(
    model: nn.Module,
    path: str,
    *,
    max_shard_size: int | str = "5GB",
    shared_filesystem: bool | None = None,
    progress: bool = True,
    merge_adapters: bool = False,
) -> list[str]:
    """Write ``model`` (sharded or not) to the directory ``path`` as ``transformers.from_pretrained`` reads it:
    safetensors files of at most ``max_shard_size`` each (``model.safetensors``, or numbered files and
    ``model.safetensors.index.json``), with the model's ``config.json`` and ``generation_config.json`` when
    it has them. Values are written in the parameters' dtype, bit for bit, under the names and in the layout
    transformers' own ``save_pretrained`` writes (a mixture of experts: one tensor per expert). Call it on
    every rank.

    A peft ``PeftModel`` is written as ``PeftModel.save_pretrained`` writes it: each adapter's
    ``adapter_model.safetensors`` (peft's names) and ``adapter_config.json``, no base weights; with
    ``merge_adapters=True``, the base model with the active LoRA adapters merged into its weights instead.

    ``shared_filesystem`` (default: found out by a file rank 0 writes and every rank looks for) chooses the
    way: every rank writing its rows in place, or rank 0 writing everything. Returns the files written.

    The files are written into a fresh directory beside ``path`` and put in its place once every rank's writes
    succeeded: a failed save (a full disk on any rank) raises on every rank and leaves ``path`` as it was, a
    killed one leaves it old or new, never a mix. Files of ``path`` a save does not write (a tokenizer) are
    kept; the old weights, index and ``model.safetensors`` are not. ``path`` must not be a symbolic link.

    ``progress=False`` hides the progress bar rank 0 shows (with tqdm installed) once a save takes a few
    seconds; it counts the bytes rank 0 writes. The time and bytes each rank wrote are logged at INFO on
    the ``fsdp_compose`` logger.
    """
    began = time.perf_counter()
    reshard_idle(model, "save_pretrained")  # the modules hold the shards again (a forward without backward)
    tensors = checkpoint_tensors(model)
    for target in tensors:
        if target.tensor.is_meta:
            raise ValueError(f"save_pretrained: '{target.names[0]}' is on meta; it has no values to save")
        if target.tensor.dtype not in NAMES:
            raise ValueError(f"save_pretrained: '{target.names[0]}' has dtype {target.tensor.dtype}, which safetensors cannot hold")
    adapters = peft.holds_adapters(model)
    if merge_adapters and not adapters:
        raise ValueError("save_pretrained(merge_adapters=True): the model holds no peft adapters")
    if adapters and not merge_adapters:  # every check before the first write
        named = [(os.path.join(folder, peft.ADAPTER_FILE), members) for folder, members in peft.adapter_files(model, tensors)]
        return _save_files(path, named, lambda out: peft.write_adapter_configs(model, out.staging), shared_filesystem, progress, began)
    if merge_adapters:
        tensors = peft.merged_tensors(model, peft.split(model, tensors)[0])
    tensors = to_checkpoint_layout(model, tensors)  # conversions: the names and layout transformers writes
    files = _split(tensors, _bytes(max_shard_size))
    names = [SINGLE_NAME] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in tensors)

    def small_files(out: SaveDir) -> None:  # the index (for several files) and the configuration files
        if len(files) > 1:
            _write_index(out, names, files, total)
        _write_configs(peft.base_model(model), out.staging)

    return _save_files(path, list(zip(names, files)), small_files, shared_filesystem, progress, began)


def _save_files(
    path: str, named: list[tuple[str, list[ModelTensor]]], small_files: Callable[[SaveDir], None],
    shared_filesystem: bool | None, progress: bool, began: float,
) -> list[str]:
    """Each ``(name, tensors)`` written as a safetensors file into a fresh directory beside ``path``, then rank 0's
    ``small_files(out)``; the directory takes ``path``'s place once every rank succeeded."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = SaveDir.begin(path)  # a fresh directory beside path, put in its place once every rank's writes succeeded
    if shared_filesystem is None:
        shared_filesystem = out.shared()
    total = sum(t.tensor.numel() * t.tensor.dtype.itemsize for _, members in named for t in members)
    mine = [sum(_written_here(t, rank, shared_filesystem) for t in members) for _, members in named]
    failure = None  # this rank's first failed write: kept, so that it still takes part in every collective
    with progress_bar(sum(mine), "save_pretrained", enabled=progress) as bar:
        for (name, members), written in zip(named, mine):
            header, offsets = header_bytes(
                [(t.names[0], t.tensor.dtype, tuple(t.tensor.shape)) for t in members], {"format": "pt"}
            )
            if shared_filesystem:
                failure = _write_rows(out, name, header, offsets, members, rank, failure)
            else:
                failure = _write_whole(out, name, header, offsets, members, rank, failure)
            bar.update(written)
    if rank == 0 and failure is None:
        failure = attempt(lambda: small_files(out), out.path("config.json"))
    out.finish(failure)  # every rank raises if one failed; else the new directory takes the target's place
    logger.info(
        "save_pretrained: %d file(s) of %.1f MiB to %s in %.2f s; %s wrote %.1f MiB (%s)", len(named),
        total / 2**20, path, time.perf_counter() - began, f"rank {rank}" if dist.is_initialized() else "this process",
        sum(mine) / 2**20, "its rows, in place" if shared_filesystem else "rank 0 writes every file",
    )
    return [os.path.join(path, name) for name, _ in named]


def _writes(tensor: torch.Tensor, region: Region, rank: int) -> bool:
    """Whether this rank writes its region of ``tensor`` in place: one replica of each row, rank 0 a plain tensor."""
    return region.writer and (isinstance(tensor, DTensor) or rank == 0)


def _written_here(target: ModelTensor, rank: int, shared_filesystem: bool) -> int:
    """The bytes of ``target`` this rank writes: its rows (shared filesystem), or all of it on rank 0. A tensor
    made by conversions (one expert of a fused parameter) counts on rank 0 only: its pieces are found as written."""
    tensor = target.tensor
    if not shared_filesystem or isinstance(target, ConvertedTensor):
        return tensor.numel() * tensor.dtype.itemsize if rank == 0 else 0
    region = region_of(tensor, target.names[0])
    return sum(n for *_, n in region.runs(tensor.dtype.itemsize)) if _writes(tensor, region, rank) else 0


def _write_rows(
    out: SaveDir, name: str, header: bytes, offsets: dict[str, int], members: list[ModelTensor], rank: int,
    failure: str | None,
) -> str | None:
    """Rank 0 creates the file at full size with its header; then every rank writes its own rows into it."""
    if rank == 0 and failure is None:
        size = len(header) + sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in members)
        failure = attempt(lambda: out.create(name, header, size), out.path(name))
    _barrier()
    if failure is None:
        failure = attempt(lambda: _pwrite_rows(out.open_rows(name), offsets, members, rank), out.path(name))
    _barrier()
    return failure


def _pwrite_rows(fd: int, offsets: dict[str, int], members: list[ModelTensor], rank: int) -> None:
    try:
        for target in members:
            if isinstance(target, ConvertedTensor):  # conversions: the parts of it this rank's shards hold
                for in_tensor, data in target.rows(rank):
                    pwrite_all(fd, data, offsets[target.names[0]] + in_tensor)
                continue
            tensor = target.tensor
            region = region_of(tensor, target.names[0])
            if not _writes(tensor, region, rank):
                continue
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            data = local.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
            for in_tensor, in_local, n in region.runs(tensor.dtype.itemsize):
                pwrite_all(fd, memoryview(data)[in_local : in_local + n], offsets[target.names[0]] + in_tensor)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_whole(
    out: SaveDir, name: str, header: bytes, offsets: dict[str, int], members: list[ModelTensor], rank: int,
    failure: str | None,
) -> str | None:
    """Rank 0 writes the file; each tensor is gathered whole, one at a time (every rank takes part)."""
    fd = None
    if rank == 0 and failure is None:
        size = len(header) + sum(t.tensor.numel() * t.tensor.dtype.itemsize for t in members)
        failure = attempt(lambda: out.create(name, header, size), out.path(name))
        if failure is None:
            try:
                fd = out.open_rows(name)
            except OSError as error:
                failure = f"{out.path(name)}: {type(error).__name__}: {error.strerror or error}"
    try:
        for member in members:
            tensor = member.tensor
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if isinstance(member, ConvertedTensor):  # conversions: made of the model's tensors, each gathered once
                full = member.whole()
            if fd is not None and failure is None:
                data = full.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
                failure = attempt(lambda: pwrite_all(fd, memoryview(data), offsets[member.names[0]]), out.path(name))
            del full
        if fd is not None and failure is None:
            failure = attempt(lambda: os.fsync(fd), out.path(name))
    finally:
        if fd is not None:
            os.close(fd)
    return failure


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


def _write_index(out: SaveDir, names: list[str], files: list[list[ModelTensor]], total: int) -> None:
    weight_map = {t.names[0]: name for name, members in zip(names, files) for t in members}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out.write_new(INDEX_NAME, json.dumps(index, indent=2).encode())


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
