"""Per-file checksums of a checkpoint, written after a save and verified before a load.

``checksums.json`` in the checkpoint directory records each file's size and CRC-32. Ranks
hash disjoint slices of the file list in parallel and exchange results, so every rank raises
the same ``CheckpointError`` naming the bad file (flipped byte, truncated, missing). The
owner file in a ``.partial`` directory says which process's save is writing it, so a later
save removes only leftovers that no live save owns.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from pathlib import Path

import torch.distributed as dist

from .errors import CheckpointError

MANIFEST = "checksums.json"
OWNER = "owner.json"
_CHUNK = 1 << 22
_live_saves: set[str] = set()  # partial directories this process is writing now


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
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


def _problem(path: Path, expected: dict) -> str | None:
    if not path.exists():
        return "missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{size} bytes, {expected['bytes']} recorded (truncated or overwritten)"
    if crc32_of(path) != expected["crc32"]:
        return "checksum mismatch (the file's bytes changed since it was saved)"
    return None


def verify(directory: Path) -> None:
    """Collective: check every recorded file; every rank raises the same error naming bad files."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        problems = {MANIFEST: f"unreadable ({type(error).__name__}: {error})"}
    else:
        problems = {}
        for name in _my_share(sorted(files)):
            found = _problem(directory / name, files[name])
            if found is not None:
                problems[name] = found
    problems = _gather(problems)
    if problems:
        lines = [f"  file {str(directory / name)!r}: {what}" for name, what in sorted(problems.items())]
        raise CheckpointError(
            f"checkpoint {str(directory)!r} failed its integrity check; nothing was loaded:\n" + "\n".join(lines)
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
