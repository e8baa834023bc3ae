"""Per-file checksums of a checkpoint, written after a save and verified before a load.

``checksums.json`` in the checkpoint directory records each file's size and CRC-32. Ranks
hash disjoint slices of the file list in parallel and exchange results, so every rank raises
the same ``CheckpointError`` naming the bad file (flipped byte, truncated, missing). Verifying
reads only what ``files.py`` admits (bare names, regular files, at most the recorded size, the
manifest itself bounded), turns every ``OSError`` into a line of the verdict, and checks that the
manifest covers every file the metadata names, so every rank reaches the same verdict. The
owner file in a ``.partial`` directory says which process's save is writing it, so a later
save removes only leftovers that no live save owns.
"""

from __future__ import annotations

import io
import json
import os
import socket
import zlib
from pathlib import Path

import torch.distributed as dist

from torch.distributed.checkpoint.metadata import Metadata

from ...extras_api import raise_together
from . import files, safety
from .errors import CheckpointError

MANIFEST = "checksums.json"
OWNER = "owner.json"
_CHUNK = 1 << 22
MANIFEST_LIMIT = 16 << 20  # ~100 bytes a file: far more files than any checkpoint has
_live_saves: set[str] = set()  # partial directories this process is writing now


def crc32_of(path: Path) -> int:
    with open(path, "rb") as f:
        return _crc32_of_first(f, os.fstat(f.fileno()).st_size)


def _crc32_of_first(file, length: int) -> int:
    """The CRC-32 of the file's first ``length`` bytes (fewer if it ends sooner): never reads past them."""
    crc, left = 0, length
    while left and (chunk := file.read(min(_CHUNK, left))):
        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    return crc


def _my_share(names: list[str]) -> list[str]:
    return names[dist.get_rank() :: dist.get_world_size()]


def _gather(mine: dict) -> dict:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def record_checksums(directory: Path) -> dict:
    """Collective: hash every file DCP wrote into ``directory``; rank 0 writes the manifest."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in (MANIFEST, OWNER))
    mine = {}
    for name in _my_share(names):
        path = directory / name
        mine[name] = {"bytes": path.stat().st_size, "crc32": crc32_of(path)}
    return {"algorithm": "crc32", "files": _gather(mine)}


def write_manifest(directory: Path, manifest: dict) -> None:
    """Rank 0: write ``checksums.json`` and flush it to disk."""
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _problem(directory: Path, name: str, expected: object) -> str | None:
    """What is wrong with one file of the manifest, or None; never raises, never reads past its record."""
    if not (isinstance(expected, dict) and type(expected.get("bytes")) is int and type(expected.get("crc32")) is int):
        return f"recorded as {str(expected)[:80]!r} in {MANIFEST}, not as its size and CRC-32"
    try:
        with files.open_regular(directory, name) as file:
            size = files.size_of(file)
            if size != expected["bytes"]:
                return f"{size} bytes, {expected['bytes']} recorded (truncated or overwritten)"
            if _crc32_of_first(file, size) != expected["crc32"]:
                return "checksum mismatch (the file's bytes changed since it was saved)"
    except files.FileRefused as refused:
        return refused.reason
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable ({type(error).__name__}: {error.strerror})"
    return None


def _read_manifest(directory: Path) -> dict:
    """``checksums.json``'s table of files, read whole but bounded; raises what is wrong with it."""
    manifest = json.loads(files.read_whole(directory, MANIFEST, MANIFEST_LIMIT))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("no table of files")
    return manifest["files"]


def _checked_metadata(directory: Path, listed: dict | None) -> tuple[Metadata | None, list[str]]:
    """The metadata, and what keeps its storage entries from being read (``files.storage_problems``)."""
    path = str(directory / files.METADATA)
    try:
        if listed is not None and files.METADATA not in listed:
            return None, [f"file {files.METADATA!r} is not in {MANIFEST}, so nothing vouches for it"]
        with files.open_regular(directory, files.METADATA) as file:  # unpickled as it is read: no copy of it
            size = files.size_of(file)
            if size > files.METADATA_LIMIT:
                raise files.FileRefused(
                    path, f"{size} bytes, more than the {files.METADATA_LIMIT} a checkpoint's metadata is let hold "
                    "(files.METADATA_LIMIT); refused unread"
                )
            metadata = safety.read_metadata(path, io.BufferedReader(files.Window(file, 0, size)))
        return metadata, files.storage_problems(directory, metadata, listed)
    except CheckpointError as error:
        return None, [str(error)]
    except FileNotFoundError:
        return None, [f"file {path!r}: missing"]
    except Exception as error:  # noqa: BLE001 - an OSError, or a crafted table; a line of the verdict either way
        return None, [f"file {path!r}: unusable ({type(error).__name__}: {error})"]


def _label(directory: Path, name: str) -> str:
    if files.is_bare_name(name):
        return f"file {str(directory / name)!r}"
    return f"entry {name!r} of {MANIFEST}"


def verify(directory: Path, checksums: bool = True) -> Metadata:
    """Collective: check every recorded file and the metadata's storage entries; return the metadata.

    Every rank raises the same ``CheckpointError`` naming the bad files: checksum failures first,
    then entries the file layer refuses. ``checksums=False`` (a checkpoint torch's DCP wrote, which
    has none) checks the entries alone.
    """
    problems: dict[str, str] = {}
    listed = None
    if checksums:
        try:
            listed = _read_manifest(directory)
        except files.FileRefused as refused:
            problems[MANIFEST] = refused.reason
        except (OSError, ValueError, RecursionError) as error:
            problems[MANIFEST] = f"unreadable ({type(error).__name__}: {error})"
        else:
            for name in _my_share(sorted(listed)):
                found = _problem(directory, name, listed[name])
                if found is not None:
                    problems[name] = found
    metadata, layout = (None, []) if problems.get(MANIFEST) else _checked_metadata(directory, listed)
    found = (problems, layout) if problems or layout else None
    raise_together(found, cls=CheckpointError, message=lambda everyone: _verdict(directory, everyone))
    return metadata


def _verdict(directory: Path, everyone: list) -> str:
    """The message from every rank's ``(problems, layout)`` (``None`` where a rank found nothing): the files
    that failed first, else the entries the file layer refuses."""
    found = [part for part in everyone if part is not None]
    problems = {name: what for part, _ in found for name, what in part.items()}
    if problems:
        lines = [f"  {_label(directory, name)}: {what}" for name, what in sorted(problems.items())]
        return f"checkpoint {str(directory)!r} failed its integrity check; nothing was loaded:\n" + "\n".join(lines)
    layout = sorted({line for _, part in found for line in part})
    return (
        f"checkpoint {str(directory)!r} points at data it may not read; nothing was loaded:\n  "
        + "\n  ".join(layout[:12])
        + (f"\n  ... and {len(layout) - 12} more" if len(layout) > 12 else "")
    )


def claim(partial: Path) -> None:
    """Rank 0: mark ``partial`` as written by this process's live save."""
    _live_saves.add(str(partial))
    (partial / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def release(partial: Path) -> None:
    _live_saves.discard(str(partial))


def stale(partial: Path) -> bool:
    """Whether a leftover ``partial`` belongs to no live save (its writer died or finished).

    A save in this process is live while it runs; another process on this host is live while its
    pid exists; a leftover from another host is treated as stale (two jobs must not save to one
    path at once).
    """
    if str(partial) in _live_saves:
        return False
    try:
        owner = json.loads((partial / OWNER).read_text())
    except (OSError, ValueError):
        return True
    if owner.get("host") != socket.gethostname() or owner.get("pid") == os.getpid():
        return True
    try:
        os.kill(int(owner["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError, TypeError):
        return True
    except PermissionError:
        return False
    return False
