"""Loading a checkpoint runs no code from it: every pickled piece is read through an allowlist.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with ``pickle.load`` and each
value that is not a tensor (``step``, ``extra``, optimizer hyperparameters) with
``torch.load(weights_only=False)``: a crafted file can run any code while being read, and a
rewritten ``checksums.json`` passes the integrity check. ``read_metadata`` reads the metadata with an
unpickler admitting only DCP's metadata classes (dataclasses and enums of
``torch.distributed.checkpoint``), torch's sizes, dtypes and layouts, and paths; ``SafeLoadPlanner``
admits a value only as ``torch.load(weights_only=True)`` does (containers, numbers, strings,
tensors), parsing each once, and no deeper than ``MAX_DEPTH``. Anything else raises
``CheckpointError`` naming the file and what it tried to load, before it is built. Tensors are read
with ``weights_only=True`` (``reader.py``), and every payload's zip is checked before it is
inflated (``files.check_payload``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pathlib
import pickle
import re
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointError

_DCP_PACKAGE = "torch.distributed.checkpoint"
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _admitted(module: str, name: str) -> Any:
    """The object a metadata pickle may name, or None: DCP's data classes, torch's sizes and dtypes."""
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)  # the checkpoint id in StorageMeta; building one runs nothing
    if module == "torch.serialization" and name == "_get_layout":  # a layout by name: a dictionary lookup
        return torch.serialization._get_layout
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, _TORCH_VALUES) else None
    if module == _DCP_PACKAGE or module.startswith(_DCP_PACKAGE + "."):
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            return value
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        admitted = _admitted(module, name)
        if admitted is None:
            raise CheckpointError(
                f"checkpoint file {self.where!r} asks to load {module}.{name}, which a checkpoint's metadata never "
                "holds; refused before anything in it ran (a crafted or foreign file)"
            )
        return admitted


def read_metadata(path: str, stream) -> Metadata:
    """DCP's metadata from ``stream`` (the file ``path``), through the allowlist."""
    try:
        metadata = _MetadataUnpickler(stream, path).load()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure means an unusable file
        raise CheckpointError(f"checkpoint file {path!r} is not readable metadata: {error}") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path!r} holds a {type(metadata).__name__}, not DCP's metadata")
    return metadata


def load_plain(data: bytes | io.BytesIO, where: str) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (no deeper than ``MAX_DEPTH``), a refusal raised as
    ``CheckpointError`` naming ``where``."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        value = torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        detail = re.search(r"WeightsUnpickler error: *\n*(.+)", str(error))
        refused = detail.group(1).strip() if detail else error
        what = f"asks to load {found.group(1)}, which" if found else f"holds what plain data ({refused}) and"
        raise CheckpointError(
            f"checkpoint value {where} {what} plain data never needs; refused before anything in it ran "
            "(a crafted file, or one saved with objects other than containers, numbers, strings and tensors)"
        ) from None
    except (RecursionError, MemoryError, EOFError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"checkpoint value {where} is unreadable ({type(error).__name__}: {error})") from None
    found = not_plain(value, f"value {where}", any_leaf=True)
    if found is not None:
        raise CheckpointError(f"checkpoint {found}; refused (a crafted file)")
    return value


_SCALARS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.Size, torch.Tensor)
MAX_DEPTH = 100  # containers in containers; pickling or printing a much deeper value overflows the stack


def not_plain(value: Any, where: str = "extra", any_leaf: bool = False) -> str | None:
    """Where in ``value`` something is not plain data (what ``torch.load(weights_only=True)`` admits:
    dicts, lists, tuples, strings, numbers, booleans, None, tensors) or nests deeper than ``MAX_DEPTH``,
    and what it is; None if all is. Walked with a stack of its own, so any depth is reported, never a
    ``RecursionError``. ``any_leaf``: check only the depth (torch.load's allowlist has checked the kinds)."""
    pending = [(value, where, 0)]
    while pending:
        value, where, depth = pending.pop()
        kind = type(value)
        if kind in _SCALARS or (any_leaf and kind not in (dict, OrderedDict, list, tuple)):
            continue
        if kind not in (dict, OrderedDict, list, tuple):
            return f"{where}: a {kind.__module__}.{kind.__qualname__}"
        if depth == MAX_DEPTH:
            return f"{where.split('[')[0]}: containers nested more than {MAX_DEPTH} deep"
        if kind in (dict, OrderedDict):
            items = [(key, f"{where} (a key)") for key in value] + [(v, f"{where}[{k!r}]") for k, v in value.items()]
        else:
            items = [(item, f"{where}[{i}]") for i, item in enumerate(value)]
        pending += [(item, place, depth + 1) for item, place in reversed(items)]
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner admitting only plain data in the values it reads as bytes, each parsed once."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index)
        where = f"'{read_item.dest_index.fqn}'" + (f" in file {info.relative_path!r}" if info is not None else "")
        loaded = load_plain(value, where)
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it, without a second parse
            _set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _set_at(tree: Any, path: tuple, value: Any) -> None:
    """``tree[path[0]][path[1]]... = value``: a flattened key's place in the nested state dict."""
    for step in path[:-1]:
        tree = tree[step]
    tree[path[-1]] = value
