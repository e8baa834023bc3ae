"""Which files make a Hugging Face checkpoint, and every tensor in them, checked, with nothing read outside it.

A checkpoint is a directory holding ``model.safetensors.index.json`` (its ``weight_map`` names each tensor's
file) and those files, or one ``model.safetensors``; or a single ``.safetensors`` file given by path. Files
the index names must lie inside the directory once links are resolved.
"""

from __future__ import annotations

import json
import os

from .safetensors_file import Header, PretrainedCheckpointError, TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_files(path: str) -> tuple[list[str], dict[str, str]]:
    """The files of the checkpoint at ``path`` and, for an indexed one, its ``weight_map`` (else ``{}``)."""
    if os.path.isfile(path):
        return [path], {}
    if not os.path.isdir(path):
        raise PretrainedCheckpointError(f"{path}: no such checkpoint file or directory")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        weight_map = _weight_map(index)
        names = sorted(set(weight_map.values()))
        return [_inside(path, name, index) for name in names], weight_map
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [_inside(path, SINGLE_NAME, single)], {}
    raise PretrainedCheckpointError(f"{path}: holds neither {INDEX_NAME} nor {SINGLE_NAME}")


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise PretrainedCheckpointError(f"{index}: not a JSON object with a 'weight_map' ({error})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PretrainedCheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _inside(directory: str, name: str, named_by: str) -> str:
    """``directory/name``, refused where it resolves outside ``directory`` (``..``, an absolute name, a link)."""
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, target]) != root or target == root:
        raise PretrainedCheckpointError(f"{named_by}: file '{name}' lies outside the checkpoint directory {directory}; refused")
    if not os.path.isfile(target):
        raise PretrainedCheckpointError(f"{named_by}: names file '{name}', which does not exist")
    return target


def read_checkpoint(path: str) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint at ``path`` by name, each header checked (reads headers only)."""
    files, weight_map = checkpoint_files(path)
    headers: list[Header] = [read_header(f) for f in files]
    tensors: dict[str, TensorEntry] = {}
    for header in headers:
        for name, entry in header.entries.items():
            if name in tensors:
                raise PretrainedCheckpointError(f"tensor '{name}' is in two files: {tensors[name].file} and {entry.file}")
            tensors[name] = entry
    index = os.path.join(path, INDEX_NAME)
    for name, file in weight_map.items():
        entry = tensors.get(name)
        if entry is None or entry.file != os.path.realpath(os.path.join(path, file)):
            raise PretrainedCheckpointError(f"{index}: tensor '{name}' is mapped to '{file}', whose header does not hold it")
    return tensors
