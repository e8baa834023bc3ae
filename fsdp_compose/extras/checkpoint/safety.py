"""Loading a checkpoint runs no code from it: every pickled piece is read through an allowlist.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with ``pickle.load`` and each
value that is not a tensor (``step``, ``extra``, optimizer hyperparameters) with
``torch.load(weights_only=False)``: a crafted file can run any code while being read, and a
rewritten ``checksums.json`` passes the integrity check. ``SafeReader`` reads the metadata with an
unpickler admitting only DCP's metadata classes (dataclasses and enums of
``torch.distributed.checkpoint``), torch's sizes, dtypes and layouts, and paths; ``SafeLoadPlanner``
admits a value only as ``torch.load(weights_only=True)`` does (containers, numbers, strings,
tensors). Anything else raises ``CheckpointError`` naming the file and what it tried to load,
before it is built. Tensors DCP already reads with ``weights_only=True``.
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
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
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


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(str(path), stream)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def load_plain(data: bytes | io.BytesIO, where: str) -> Any:
    """``torch.load(weights_only=True)`` of ``data``, a refusal raised as ``CheckpointError`` naming ``where``."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        detail = re.search(r"WeightsUnpickler error: *\n*(.+)", str(error))
        refused = detail.group(1).strip() if detail else error
        what = f"asks to load {found.group(1)}, which" if found else f"holds what plain data ({refused}) and"
        raise CheckpointError(
            f"checkpoint value {where} {what} plain data never needs; refused before anything in it ran "
            "(a crafted file, or one saved with objects other than containers, numbers, strings and tensors)"
        ) from None


_SCALARS = (str, bytes, int, float, bool, type(None), torch.dtype)


def not_plain(value: Any, where: str = "extra") -> str | None:
    """Where in ``value`` something is not plain data (what ``torch.load(weights_only=True)`` admits:
    dicts, lists, tuples, strings, numbers, booleans, None, tensors), and what it is; None if all is."""
    kind = type(value)
    if kind in _SCALARS or kind is torch.Size or kind is torch.Tensor:
        return None
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            found = not_plain(key, f"{where} (a key)") or not_plain(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if kind in (list, tuple):
        return next((f for i, item in enumerate(value) if (f := not_plain(item, f"{where}[{i}]"))), None)
    return f"{where}: a {kind.__module__}.{kind.__qualname__}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner admitting only plain data in the values it reads as bytes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index)
        where = f"'{read_item.dest_index.fqn}'" + (f" in file {info.relative_path!r}" if info is not None else "")
        load_plain(value, where)  # refuses a crafted value; what passes loads alike without the allowlist
        value.seek(0)
        super().load_bytes(read_item, value)
