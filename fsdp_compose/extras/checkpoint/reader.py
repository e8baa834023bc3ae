"""DCP's storage reader, rewritten to read through the file layer's checks.

``CheckedReader`` is handed metadata already read and checked (``integrity.verify``), so DCP
reads no ``.metadata`` of its own. Each item is read through a window on a regular file opened
without following a link (``files.Window``: no read reaches past the item), its zip checked before
torch reads a record (``files.check_payload``), and a
tensor's storage checked against the chunk it claims to be before it is narrowed and copied. Any
failure is a ``CheckpointError`` naming the key and the file; DCP gathers each rank's failure
and raises on every rank.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from . import files
from .errors import CheckpointError


class CheckedReader(StorageReader):
    """A ``StorageReader`` for a checkpoint directory whose metadata ``storage_problems`` passed."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__()
        self.directory = directory
        self.metadata = metadata
        self.chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.chunk_sizes = {
            (fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # built for one directory only; never chosen by DCP from a path

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.metadata.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            path = os.path.join(self.directory, name)
            items.sort(key=lambda item: self.metadata.storage_data[item.storage_index].offset)
            where = f"key {items[0].storage_index.fqn!r} in file {path!r}"
            try:
                with files.open_regular(self.directory, name) as file:
                    size = files.size_of(file)
                    for item in items:
                        where = f"key {item.storage_index.fqn!r} in file {path!r}"
                        self._read_item(file, size, item, planner, where)
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 - the OS and torch's reader fail many ways; each is named
                raise CheckpointError(f"{where}: unreadable ({type(error).__name__}: {error})") from None
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, file, size: int, item: ReadItem, planner: LoadPlanner, where: str) -> None:
        info = self.metadata.storage_data[item.storage_index]
        if info.offset + info.length > size:
            raise CheckpointError(f"{where}: bytes {info.offset} + {info.length}, past the file's {size}")
        item_bytes = files.Window(file, info.offset, info.length)
        files.check_payload(item_bytes, where)
        item_bytes.seek(0)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(item_bytes.read(info.length)))
            return
        tensor = torch.load(item_bytes, map_location="cpu", weights_only=True)
        chunk = self.chunk_sizes.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
        if not isinstance(tensor, torch.Tensor) or chunk is None or tuple(tensor.shape) != chunk:
            what = f"a tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else "no tensor"
            raise CheckpointError(f"{where}: holds {what}, where the metadata's chunk is {chunk}")
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            raise CheckpointError(
                f"{where}: storage of {tensor.untyped_storage().nbytes()} bytes for {tensor.numel()} elements of "
                f"{tensor.dtype} (DCP writes exactly the chunk)"
            )
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.shape != tensor.shape or target.dtype != tensor.dtype:
            raise CheckpointError(
                f"{where}: {tuple(tensor.shape)} {tensor.dtype} read, {tuple(target.shape)} {target.dtype} expected"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
