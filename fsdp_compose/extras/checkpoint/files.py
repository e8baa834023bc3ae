"""A checkpoint reads only its own files: bare names, regular files, reads bounded by what is on disk.

torch's DCP opens ``Path(dir) / relative_path`` for whatever its metadata names, following ``..``,
absolute paths and symlinks, and reads whatever length it says: another job's shard loads into
the model, and ``/dev/zero`` with a 2 GiB length eats memory. Here a file is named by a bare file
name in the checkpoint directory; ``lstat`` must show a regular file before it is opened (a
symlink could lead out of the directory, a FIFO blocks, a device never ends, a directory hangs),
it is opened without following a link and checked again once open, and no read goes past the
size seen. ``storage_problems`` checks every storage entry of the metadata this way before a
single data byte is read; ``check_payload`` checks an item's zip before torch inflates it.
``CheckedFile`` keeps such a file open and reads it by offset from the descriptor it checked, and says
whether the file changed since (``load_pretrained`` reads safetensors files this way);
``parse_json`` reads JSON as safetensors does (UTF-8 only, no duplicate names, no deep nesting).
"""

from __future__ import annotations

import io
import json
import os
import stat
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointError

METADATA = ".metadata"  # DCP's name for a checkpoint's metadata file
# DCP writes ~250 bytes of metadata a stored chunk: about a million chunks (a checkpoint this large: raise it)
METADATA_LIMIT = 256 << 20
# open flags: never through a link, never blocking (a FIFO swapped in after lstat); 0 where the OS lacks one
_NO_LINK_NO_WAIT = sum(getattr(os, flag, 0) for flag in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"))


class FileRefused(CheckpointError):
    """A file of the checkpoint that is not read: ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"file {path!r}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):  # rebuilt from its two fields: DCP passes a rank's failure to the others pickled
        return type(self), (self.path, self.reason)


def is_bare_name(name: object) -> bool:
    """Whether ``name`` names a file right in a directory: no separator, not ``.`` or ``..``, not absolute."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in ("/", "\\", "\0"))
    )


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _open_checked(directory: Path | str, name: str) -> tuple[int, os.stat_result]:
    """A descriptor of ``directory/name`` and its ``fstat``, only if it is a regular file named by a bare name."""
    path = os.path.join(directory, name) if is_bare_name(name) else None
    if path is None:
        raise FileRefused(str(name), "not a file name in the checkpoint directory (a path), never opened")
    seen = os.lstat(path)
    if not stat.S_ISREG(seen.st_mode):
        raise FileRefused(path, f"{_kind(seen.st_mode)}, not a regular file; never opened")
    fd = os.open(path, os.O_RDONLY | _NO_LINK_NO_WAIT)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
            raise FileRefused(path, "replaced while it was being opened")
        return fd, now
    except BaseException:
        os.close(fd)
        raise


def open_regular(directory: Path | str, name: str) -> BinaryIO:
    """``directory/name`` opened for reading, only if it is a regular file named by a bare name.

    Raises ``FileRefused`` for anything else and ``OSError`` (``FileNotFoundError`` included) as
    the file system does; the file is never opened through a link, and never blocks.
    """
    fd, _ = _open_checked(directory, name)
    return os.fdopen(fd, "rb")


class CheckedFile:
    """A regular file opened as ``open_regular`` opens it, kept open: every read is by offset from the
    descriptor that was checked and within the size seen then, so a name swapped afterwards for a link, a
    FIFO or another file is never read through; ``changed`` says whether the file was since replaced,
    removed, resized or written."""

    def __init__(self, directory: Path | str, name: str) -> None:
        self.path = os.path.join(directory, name)
        self.fd, self.seen = _open_checked(directory, name)
        self.size = self.seen.st_size

    def __enter__(self) -> CheckedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_at(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(memoryview(buffer), offset)
        return bytes(buffer)

    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` from byte ``offset``: all of it, or ``FileRefused`` (the file ended sooner)."""
        end = offset + len(buffer)
        if offset < 0 or end > self.size:
            raise FileRefused(self.path, f"bytes {offset} to {end} asked for, past its {self.size} bytes")
        done = 0
        while done < len(buffer):
            got = _pread_into(self.fd, buffer[done:], offset + done)
            if not got:
                held = f"short of the {self.size} it held when checked (truncated)"
                raise FileRefused(self.path, f"ended at byte {offset + done}, {held}")
            done += got

    def changed(self) -> str | None:
        """What happened to the file since it was checked (replaced, removed, resized, written), or None."""
        try:
            entry = os.lstat(self.path)
        except FileNotFoundError:
            return "removed since it was checked"
        if (entry.st_dev, entry.st_ino) != (self.seen.st_dev, self.seen.st_ino):
            kind = "another file" if stat.S_ISREG(entry.st_mode) else _kind(entry.st_mode)
            return f"replaced by {kind} since it was checked; never read through it"
        now = os.fstat(self.fd)
        if now.st_size != self.seen.st_size:
            return f"{now.st_size} bytes now, {self.seen.st_size} when it was checked (truncated or rewritten)"
        if now.st_mtime_ns != self.seen.st_mtime_ns:
            return "written since it was checked"
        return None


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):  # straight into the buffer
        return os.preadv(fd, [buffer], offset)
    data = os.pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


def size_of(file: BinaryIO) -> int:
    return os.fstat(file.fileno()).st_size


def read_exactly(file: BinaryIO, length: int, path: str) -> bytes:
    """``length`` bytes from the file's position: fewer means the file shrank since it was checked."""
    data = file.read(length)
    if len(data) != length:
        raise FileRefused(path, f"ended after {len(data)} of {length} bytes (truncated while being read)")
    return data


MAX_JSON_DEPTH = 64  # safetensors' parser stops at 128; the JSON of a checkpoint nests a few levels


class _Duplicate(ValueError):
    pass


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _Duplicate(f"name {twice[:200]!r} appears twice in one object (which one is meant?)")
    return found


def parse_json(data: bytes) -> object:
    """``data`` as JSON, taken as safetensors' reader takes it: UTF-8 only (``json.loads`` of bytes would also
    guess UTF-16 and UTF-32), no name twice in one object, nesting at most ``MAX_JSON_DEPTH`` deep (checked
    without recursion, so no ``RecursionError`` escapes, here or where the value is printed later). Raises
    ``ValueError`` saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 ({error})") from None
    try:
        value = json.loads(text, object_pairs_hook=_unique)
    except _Duplicate as error:
        raise ValueError(str(error)) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    except RecursionError:  # nested deeper than Python's parser goes: far past the limit
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep") from None
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth == MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep")
            pending += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return value


def read_whole(directory: Path, name: str, limit: int | None = None) -> bytes:
    """The whole regular file ``directory/name``, refused if it holds more than ``limit`` bytes."""
    with open_regular(directory, name) as file:
        size = size_of(file)
        if limit is not None and size > limit:
            raise FileRefused(os.path.join(directory, name), f"{size} bytes, more than the {limit} such a file holds")
        return read_exactly(file, size, os.path.join(directory, name))


class Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of an open file, read as a file of their own: no read
    reaches past them, whatever the zip inside claims. torch reads records with ``readinto``, so a
    tensor goes from the file into its storage in one copy, as with DCP's own reader."""

    def __init__(self, file: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(start + position, 0), self.length)
        return self.position

    def readinto(self, buffer) -> int:
        wanted = min(len(buffer), self.length - self.position)
        if wanted <= 0:
            return 0
        self.file.seek(self.offset + self.position)
        got = self.file.readinto(memoryview(buffer).cast("B")[:wanted]) or 0
        self.position += got
        return got


def storage_problems(directory: Path, metadata: Metadata, listed: Collection[str] | None) -> list[str]:
    """What keeps the metadata's storage entries from being read safely, one line per file or key.

    Each entry must name a bare file name (listed in ``checksums.json``, when ``listed`` is given),
    a regular file, and a byte range inside it; entries stored through a transform (e.g. zstd) are
    refused: what they inflate to is known only after inflating. Nothing here reads a data byte.
    """
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return [f"file {METADATA!r} holds no table of where each value is stored"]
    sizes: dict[str, int | str] = {}
    problems = []
    for index, info in storage.items():
        key = getattr(index, "fqn", index)
        name = getattr(info, "relative_path", None)
        if not is_bare_name(name):
            problems.append(f"key {key!r}: stored at {name!r}, which is not a file name in the checkpoint directory")
            continue
        if listed is not None and name not in listed:
            problems.append(f"key {key!r}: file {name!r} is not in checksums.json, so nothing vouches for it")
            continue
        if name not in sizes:
            sizes[name] = _size_or_problem(directory, name)
            if isinstance(sizes[name], str):
                problems.append(f"file {os.path.join(directory, name)!r}: {sizes[name]}")
        size = sizes[name]
        if isinstance(size, str):
            continue
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0 and offset + length <= size):
            problems.append(f"key {key!r}: bytes {offset!r} + {length!r} of file {name!r}, which holds {size}")
        elif getattr(info, "transform_descriptors", None):
            problems.append(
                f"key {key!r} in file {name!r}: stored through {list(info.transform_descriptors)!r}, which this "
                "loader does not read (what it inflates to is known only after inflating)"
            )
    return problems


def _size_or_problem(directory: Path, name: str) -> int | str:
    try:
        with open_regular(directory, name) as file:
            return size_of(file)
    except FileRefused as refused:
        return refused.reason
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable ({type(error).__name__}: {error.strerror})"


def check_payload(data: bytes | Window, where: str) -> None:
    """An item is torch.save's zip whose every record is stored (not compressed) inside ``data``.

    torch's zip reader inflates a deflated record (which ``torch.save`` never writes) before
    anything compares it with the item's size: 765 KiB became 770 MiB. Checked from the zip's
    central directory, before torch reads any record.
    """
    size = data.length if isinstance(data, Window) else len(data)
    try:
        with zipfile.ZipFile(data if isinstance(data, Window) else io.BytesIO(data)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as error:
        raise CheckpointError(f"{where}: not a torch.save archive ({error})") from None
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{where}: record {record.filename!r} is compressed (method {record.compress_type}); torch.save "
                "stores records as they are, and inflating one could take any amount of memory"
            )
        if record.file_size != record.compress_size or record.header_offset + record.compress_size > size:
            raise CheckpointError(
                f"{where}: record {record.filename!r} claims {record.file_size} bytes, beyond the item's {size}"
            )
