"""The safetensors format, read through the checkpoint file layer and written as safetensors writes it.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON, then the raw tensor bytes.
The JSON maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets from the
end of the header) and may hold ``"__metadata__"`` (an object of strings). The header is read here, from
the descriptor the file layer checked (``CheckedFile``), and checked as safetensors' own reader checks it:
UTF-8 JSON, no name twice, no deep nesting, ``__metadata__`` an object of strings, every offset inside the
file, shapes matching their byte counts, tensors back to back to the file's end. Anything else raises
``PretrainedCheckpointError`` naming the file and the key, before a byte of data is used. (``safetensors``'
``safe_open`` takes a path, not a descriptor, and maps the file: a name swapped after the checks would be
opened anew, and a file truncated under a mapping kills the process with SIGBUS.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import torch

from ..checkpoint.files import CheckedFile, parse_json

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
# safetensors' own order of its dtypes (its writer puts the last first): by element size, so each tensor stays aligned
_WRITE_ORDER = [
    *("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16"),
    *("I32", "U32", "F32", "C64", "F64", "I64", "U64"),
]
# a header larger than this is not a real one (safetensors itself refuses above 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


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
    source: CheckedFile | None = dataclasses.field(default=None, compare=False, repr=False)  # read from this

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    file: str
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    size: int  # of the whole file, in bytes


def read_header(file: CheckedFile) -> Header:
    """The checked header of the open safetensors file ``file`` (reads only the header's bytes, from its descriptor)."""
    path, size = file.path, file.size
    if size < 8:
        raise PretrainedCheckpointError(f"{path}: truncated: {size} bytes, fewer than the 8 of a header length")
    (length,) = struct.unpack("<Q", file.read_at(0, 8))
    if length > MAX_HEADER_BYTES:
        raise PretrainedCheckpointError(f"{path}: header length {length} is too large to be real (limit {MAX_HEADER_BYTES})")
    if 8 + length > size:
        raise PretrainedCheckpointError(f"{path}: truncated: the header needs {8 + length} bytes, the file has {size}")
    try:
        header = parse_json(file.read_at(8, length))
    except ValueError as error:
        raise PretrainedCheckpointError(f"{path}: the header is refused: {error}") from None
    if not isinstance(header, dict):
        raise PretrainedCheckpointError(f"{path}: the header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        kind = "an object holding more than strings" if isinstance(metadata, dict) else _JSON_KINDS[type(metadata)]
        raise PretrainedCheckpointError(
            f"{path}: '{METADATA_KEY}' must be an object mapping names to strings, not {kind}"
        )
    data_start = 8 + length
    entries = {name: _entry(path, name, value, data_start, size, file) for name, value in header.items()}
    _check_layout(path, entries, data_start, size)
    return Header(path, entries, metadata, size)


def _entry(path: str, name: str, value: object, data_start: int, size: int, source: CheckedFile) -> TensorEntry:
    def bad(why: str) -> PretrainedCheckpointError:
        return PretrainedCheckpointError(f"{path}: tensor '{name}': {why}")

    if not isinstance(value, dict):
        raise bad("its header entry is not an object")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
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
    return TensorEntry(name, dtype, tuple(shape), begin, end, path, source)


def _check_layout(path: str, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """Tensors back to back from the header's end to the file's, as safetensors writes them and its reader
    requires: no byte belongs to two tensors, none to no tensor."""
    at, before = data_start, None
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < at:
            raise PretrainedCheckpointError(
                f"{path}: tensors '{before.name}' and '{entry.name}' overlap "
                f"(bytes {before.begin}-{before.end} and {entry.begin}-{entry.end})"
            )
        if entry.begin > at:
            raise PretrainedCheckpointError(
                f"{path}: bytes {at}-{entry.begin} belong to no tensor (safetensors lays tensors back to back)"
            )
        at, before = entry.end, entry
    if at != size:
        raise PretrainedCheckpointError(
            f"{path}: {size - at} bytes after the last tensor's end (byte {at}), which safetensors' reader refuses"
        )


def header_bytes(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The header (length prefix included) of a file holding ``tensors`` back to back, and each tensor's byte
    offset from the start of the file. Laid out as safetensors' writer lays them (its dtype order, widest
    first, then by name) after a header padded with spaces to a multiple of 8: every tensor starts at a
    multiple of its element size, as zero-copy readers expect."""
    header: dict[str, object] = {METADATA_KEY: metadata}
    offset, relative = 0, {}
    for name, dtype, shape in sorted(tensors, key=lambda t: (-_WRITE_ORDER.index(NAMES[t[1]]), t[0])):
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative[name] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + off for name, off in relative.items()}
