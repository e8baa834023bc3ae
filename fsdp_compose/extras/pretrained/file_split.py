"""Cutting a model's tensors into safetensors files of at most ``max_shard_size`` each, as transformers does.

transformers 5's ``save_pretrained`` cuts them with ``huggingface_hub``'s splitter and reads ``max_shard_size``
with its parser; with ``huggingface_hub`` installed (the ``hf`` extra) the same functions cut them here, so a
save names the same files with the same tensors as transformers' for the same model and size. Without it,
``_split`` does what that splitter does: tensors in order, a new file when the next would pass the limit, and a
tensor larger than the limit alone in a file of its own, put before the file being filled. Sizes in binary
units (``"2GiB"``, which huggingface_hub refuses) and plain byte counts are read here.
"""

from __future__ import annotations

import re

from .model_tensors import ModelTensor

try:
    from huggingface_hub import split_state_dict_into_shards_factory
except ImportError:  # the hf extra is not installed
    split_state_dict_into_shards_factory = None

_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_OURS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*")


def split_into_files(tensors: list[ModelTensor], max_shard_size: int | str) -> list[list[ModelTensor]]:
    """``tensors`` cut into files (in the order of the numbered file names); refuses a size it cannot read."""
    limit = _limit(max_shard_size)
    if split_state_dict_into_shards_factory is None:
        return _split(tensors, limit if isinstance(limit, int) else _decimal(limit))
    by_name = {t.names[0]: t for t in tensors}
    try:
        split = split_state_dict_into_shards_factory(
            by_name, get_storage_size=nbytes, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
        )
    except ValueError as error:  # huggingface_hub's parser refused the string
        raise ValueError(f"save_pretrained: max_shard_size {max_shard_size!r} is not a size such as 5GB, 500MB or 2GiB ({error})") from None
    return [[by_name[name] for name in names] for names in split.filename_to_tensors.values()] or [[]]  # no tensor: one empty file


def nbytes(target: ModelTensor) -> int:
    """The bytes ``target`` takes in a file (a DTensor: its full value's)."""
    return target.tensor.numel() * target.tensor.dtype.itemsize


def _limit(size: int | str) -> int | str:
    """An int for what huggingface_hub does not read (binary units, bytes); a decimal-unit string is left to it."""
    if isinstance(size, int):
        return size
    match = _SIZE.fullmatch(size.upper())
    if not match:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is not a size such as 5GB, 500MB or 2GiB")
    unit = match.group(2) or ""
    return int(float(match.group(1)) * _OURS[unit]) if unit in _OURS else size


def _decimal(size: str) -> int:
    match = _SIZE.fullmatch(size.upper())
    return int(float(match.group(1)) * _DECIMAL[match.group(2)])


def _split(tensors: list[ModelTensor], limit: int) -> list[list[ModelTensor]]:
    """huggingface_hub's cut, for where it is not installed (see the module's docstring)."""
    files: list[list[ModelTensor]] = []
    current: list[ModelTensor] = []
    size = 0
    for target in tensors:
        n = nbytes(target)
        if n > limit:
            files.append([target])
            continue
        if current and size + n > limit:
            files.append(current)
            current, size = [], 0
        current.append(target)
        size += n
    if current or not files:
        files.append(current)
    return files
