"""The safetensors format, read and written by hand: no dependency, and every header checked before use.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON, then the raw tensor bytes.
The JSON maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets from the
end of the header) and may hold ``"__metadata__"`` (strings). A header read here is one whose every
offset lies inside the file, whose entries do not overlap, and whose shapes match their byte counts:
anything else raises ``PretrainedCheckpointError`` naming the file and the key, before a byte of data is used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import torch

# safetensors' dtype names (those torch has a type for)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
# a header larger than this is not a real one (safetensors itself refuses above 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"


class PretrainedCheckpointError(ValueError):
    """A checkpoint file or directory that cannot be loaded as it is; the message names the file and key."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: where its bytes lie (``begin``/``end`` from the start of the file)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    file: str
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    size: int  # of the whole file, in bytes


def read_header(path: str) -> Header:
    """The checked header of the safetensors file ``path`` (reads only the header's bytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise PretrainedCheckpointError(f"{path}: truncated: {size} bytes, fewer than the 8 of a header length")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise PretrainedCheckpointError(f"{path}: header length {length} is too large to be real (limit {MAX_HEADER_BYTES})")
        if 8 + length > size:
            raise PretrainedCheckpointError(f"{path}: truncated: the header needs {8 + length} bytes, the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PretrainedCheckpointError(f"{path}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise PretrainedCheckpointError(f"{path}: the header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PretrainedCheckpointError(f"{path}: '{METADATA_KEY}' must map names to strings")
    data_start = 8 + length
    entries = {name: _entry(path, name, value, data_start, size) for name, value in header.items()}
    _check_no_overlap(path, entries)
    return Header(path, entries, metadata, size)


def _entry(path: str, name: str, value: object, data_start: int, size: int) -> TensorEntry:
    def bad(why: str) -> PretrainedCheckpointError:
        return PretrainedCheckpointError(f"{path}: tensor '{name}': {why}")

    if not isinstance(value, dict):
        raise bad("its header entry is not an object")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype_name not in DTYPES:
        raise bad(f"dtype {dtype_name!r} is not one safetensors defines and torch has ({', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise bad(f"shape {shape} of {dtype_name} needs {expected} bytes, data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise bad(f"data_offsets {offsets} end at byte {end}, beyond the file's {size} bytes (truncated?)")
    return TensorEntry(name, dtype, tuple(shape), begin, end, path)


def _check_no_overlap(path: str, entries: dict[str, TensorEntry]) -> None:
    by_start = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.begin)
    for before, after in zip(by_start, by_start[1:]):
        if after.begin < before.end:
            raise PretrainedCheckpointError(
                f"{path}: tensors '{before.name}' and '{after.name}' overlap "
                f"(bytes {before.begin}-{before.end} and {after.begin}-{after.end})"
            )


def header_bytes(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The header (length prefix included) of a file holding ``tensors`` back to back in that order, and each
    tensor's byte offset from the start of the file. The JSON is padded with spaces to a multiple of 8, as
    safetensors writes it, so the data starts aligned."""
    header: dict[str, object] = {METADATA_KEY: metadata}
    offset, relative = 0, {}
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative[name] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + off for name, off in relative.items()}
