"""Which files make a Hugging Face checkpoint, each opened through the checkpoint file layer and kept open.

A checkpoint is a directory holding ``model.safetensors``, or ``model.safetensors.index.json`` (its
``weight_map`` names each tensor's file) and those files; or a single ``.safetensors`` file given by path.
Like transformers, a directory holding both is read through ``model.safetensors``. Every file is named by a
bare name in the directory and opened as ``extras/checkpoint/files.py`` opens one: a regular file, never
through a link, never blocking on a FIFO, checked again once open (``CheckedFile``). Its header is read from
that descriptor, and so is every tensor byte afterwards; ``OpenCheckpoint.changed`` says whether a file was
replaced, removed or resized since. JSON files are read whole, within a size limit, as UTF-8 JSON with no
name twice and no deep nesting.
"""

from __future__ import annotations

import os

from ..checkpoint.files import CheckedFile, FileRefused, is_bare_name, parse_json, read_whole
from .safetensors_file import PretrainedCheckpointError, TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
JSON_LIMIT = 64 << 20  # an index holds ~100 bytes a tensor: far more tensors than any model has


class OpenCheckpoint:
    """Every tensor of a checkpoint by name (each entry reads from its file's checked descriptor), and its
    files, open until ``close``."""

    def __init__(self, tensors: dict[str, TensorEntry], files: list[CheckedFile]) -> None:
        self.tensors, self.files = tensors, files

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for file in self.files:
            file.close()

    def changed(self) -> str | None:
        """The first file replaced, removed, resized or written since it was checked, and how; or None."""
        for file in self.files:
            try:
                found = file.changed()
            except OSError as error:
                found = f"unreadable ({type(error).__name__}: {error.strerror})"
            if found is not None:
                return f"{file.path}: {found}; nothing was loaded"
        return None


def refused(error: FileRefused | OSError, path: str) -> PretrainedCheckpointError:
    """The file layer's refusal (or the file system's error) as this package's error, naming the file."""
    if isinstance(error, FileRefused):
        hint = ""
        if error.reason.startswith("a symbolic link"):  # what a Hugging Face cache snapshot holds
            hint = " (a Hugging Face cache snapshot links its files: snapshot_download(..., local_dir=d) writes them)"
        return PretrainedCheckpointError(f"{error.path}: {error.reason}{hint}")
    if isinstance(error, FileNotFoundError):
        return PretrainedCheckpointError(f"{path}: no such file")
    return PretrainedCheckpointError(f"{path}: unreadable ({type(error).__name__}: {error.strerror or error})")


def read_json(directory: str, name: str, limit: int = JSON_LIMIT) -> object:
    """The JSON file ``directory/name`` (a bare name, a regular file of at most ``limit`` bytes), parsed."""
    path = os.path.join(directory, name)
    try:
        return parse_json(read_whole(directory, name, limit))
    except (FileRefused, OSError) as error:
        raise refused(error, path) from None
    except ValueError as error:
        raise PretrainedCheckpointError(f"{path}: refused: {error}") from None


def _checkpoint_files(path: str) -> tuple[str, list[str], dict[str, str]]:
    """The checkpoint's directory, its files' bare names and, for an indexed one, its ``weight_map`` (else ``{}``)."""
    if not os.path.isdir(path):
        if not os.path.lexists(path):
            raise PretrainedCheckpointError(f"{path}: no such checkpoint file or directory")
        return os.path.dirname(path) or ".", [os.path.basename(path)], {}
    if os.path.lexists(os.path.join(path, SINGLE_NAME)):  # a link or a FIFO too: refused when opened, not skipped
        return path, [SINGLE_NAME], {}
    index = os.path.join(path, INDEX_NAME)
    if not os.path.lexists(index):
        raise PretrainedCheckpointError(f"{path}: holds neither {SINGLE_NAME} nor {INDEX_NAME}")
    found = read_json(path, INDEX_NAME)
    weight_map = found.get("weight_map") if isinstance(found, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PretrainedCheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    for name in sorted(set(weight_map.values())):
        if not is_bare_name(name):
            raise PretrainedCheckpointError(
                f"{index}: file {name[:200]!r} is not a file name in the checkpoint directory {path} (a path); "
                "refused, never opened"
            )
    return path, sorted(set(weight_map.values())), weight_map


def open_checkpoint(path: str) -> OpenCheckpoint:
    """The checkpoint at ``path``, its files open and every header checked (reads headers only)."""
    directory, names, weight_map = _checkpoint_files(path)
    index = os.path.join(directory, INDEX_NAME)
    files: list[CheckedFile] = []
    try:
        for name in names:
            try:
                files.append(CheckedFile(directory, name))
            except FileNotFoundError:
                named_by = f"{index}: names file '{name}', which" if weight_map else f"{os.path.join(directory, name)}:"
                raise PretrainedCheckpointError(f"{named_by} does not exist") from None
            except (FileRefused, OSError) as error:
                raise refused(error, os.path.join(directory, name)) from None
        tensors: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in read_header(file).entries.items():
                if name in tensors:
                    raise PretrainedCheckpointError(f"tensor '{name}' is in two files: {tensors[name].file} and {entry.file}")
                tensors[name] = entry
        for name, file in weight_map.items():
            entry = tensors.get(name)
            if entry is None or entry.file != os.path.join(directory, file):
                raise PretrainedCheckpointError(f"{index}: tensor '{name}' is mapped to '{file}', whose header does not hold it")
        return OpenCheckpoint(tensors, files)
    except BaseException:
        for file in files:
            file.close()
        raise


def read_checkpoint(path: str) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint at ``path`` by name, each header checked (the files closed again)."""
    with open_checkpoint(path) as checkpoint:
        return checkpoint.tensors
