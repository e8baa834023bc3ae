"""Where ``save_pretrained`` writes: a fresh directory beside the target, put in its place once every rank's
writes succeeded, so the target holds the old checkpoint or the new one, never a mix.

Rank 0 creates ``.<name>.saving-<random>`` beside the target (mode 0700, so nothing can be planted in it), and
every file is created there with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and opened by the other ranks with
``O_NOFOLLOW``: no write goes through a link, whatever the target directory holds. A rank's failed write
(a full disk) is kept, not raised, so every rank still reaches each collective; ``finish`` gathers them and,
if one failed, every rank raises naming the file and rank 0 removes the staging directory. Otherwise rank 0
flushes every file, hard-links into it the target's files that this save does not replace (a tokenizer,
a README), and swaps the two directories in one step (``renameat2(RENAME_EXCHANGE)``; where the file system
cannot, two renames), moves the old directory's subdirectories across, and deletes what remains of it: the
old weights, the old index and the old ``model.safetensors``, so no reader finds a stale one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import stat
import sys
import warnings
from collections.abc import Callable

import torch.distributed as dist

from ...extras_api import raise_together
from .checkpoint_dir import INDEX_NAME, SINGLE_NAME
from .safetensors_file import PretrainedCheckpointError

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_SHARDS = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the names transformers gives a sharded save's files
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _many() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _from_rank0(value: object) -> object:
    box = [value]
    if _many():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def attempt(work: Callable[[], object], where: str) -> str | None:
    """Run ``work``; what went wrong, naming ``where``, or None. A failed write is kept, not raised, so that this
    rank still takes part in every collective until ``SaveDir.finish`` raises it on every rank."""
    try:
        work()
    except OSError as error:
        return f"{where}: {type(error).__name__}: {error.strerror or error}"
    except Exception as error:  # noqa: BLE001 - any failure on one rank must reach the others, not leave them waiting
        return f"{where}: {type(error).__name__}: {error}"
    return None


class SaveDir:
    """One save: ``staging`` (fresh, beside ``target``) until ``finish`` puts it in the target's place."""

    def __init__(self, target: str, staging: str, mode: int) -> None:
        self.target, self.staging, self.mode = target, staging, mode

    @classmethod
    def begin(cls, path: str) -> SaveDir:
        """Collective: rank 0 checks the target and creates the staging directory; every rank gets its name."""
        made: tuple[str, str, int] | str | None = None
        if _rank() == 0:
            try:
                made = _prepare(os.path.abspath(path))
            except (OSError, PretrainedCheckpointError) as error:
                made = f"save_pretrained: {path}: {error}"
        made = _from_rank0(made)
        if isinstance(made, str):
            raise PretrainedCheckpointError(made)
        return cls(*made)

    def path(self, name: str) -> str:
        return os.path.join(self.staging, name)

    def create(self, name: str, header: bytes, size: int) -> None:
        """Rank 0: a new file ``name`` of ``size`` bytes starting with ``header`` (never an existing one or a link)."""
        if os.path.dirname(name):  # an adapter's subfolder (peft saves each extra adapter in its own)
            os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
        fd = os.open(self.path(name), _CREATE, 0o644)
        try:
            pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def open_rows(self, name: str) -> int:
        """A descriptor to write rows into ``name``, which rank 0 created: a regular file, never through a link."""
        fd = os.open(self.path(name), _OPEN)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", self.path(name))
        return fd

    def write_new(self, name: str, data: bytes) -> None:
        """Rank 0: a new file ``name`` holding ``data``, flushed to disk."""
        fd = os.open(self.path(name), _CREATE, 0o644)
        try:
            pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def shared(self) -> bool:
        """Collective: whether every rank sees the file rank 0 writes in the staging directory."""
        if not _many():
            return True
        token = secrets.token_hex(8)
        if _rank() == 0 and attempt(lambda: self.write_new(".probe", token.encode()), ".probe") is not None:
            token = None  # rank 0 could not write it: rank 0 then writes everything, and reports what fails
        token = _from_rank0(token)
        try:
            with open(self.path(".probe"), "rb") as f:
                sees = token is not None and f.read() == token.encode()
        except OSError:
            sees = False
        answers: list = [None] * dist.get_world_size()
        dist.all_gather_object(answers, sees)
        if _rank() == 0 and token is not None:
            os.remove(self.path(".probe"))
        return all(answers)

    def finish(self, failure: str | None) -> None:
        """Collective: if any rank's write failed, every rank raises and the target is left as it was; else rank 0
        puts the new directory in the target's place."""
        try:
            raise_together(failure, cls=PretrainedCheckpointError)
            published = attempt(self._publish, self.target) if _rank() == 0 else None
            raise_together(published, cls=PretrainedCheckpointError, source=0)
        except PretrainedCheckpointError as error:
            if _rank() == 0:
                shutil.rmtree(self.staging, ignore_errors=True)
            raise PretrainedCheckpointError(f"save_pretrained to {self.target} failed; it was left as it was: {error}") from None

    def _publish(self) -> None:
        """Rank 0: flush, carry the target's other files over, swap; then clear the old directory away."""
        written = set(os.listdir(self.staging))
        for name in written:
            _fsync(self.path(name), os.O_RDONLY)
        os.chmod(self.staging, self.mode)
        _fsync(self.staging, _DIRECTORY)
        folders, old = [], None
        if os.path.lexists(self.target):
            folders = _carry_over(self.target, self.staging, written)
            old = _swap(self.staging, self.target)
        else:
            os.rename(self.staging, self.target)
        try:  # the new checkpoint is in place: what fails now is tidying up, said but not raised
            _fsync(os.path.dirname(self.target), _DIRECTORY)
            for name in folders:  # the old directory's subdirectories, moved across whole
                os.rename(os.path.join(old, name), os.path.join(self.target, name))
            if old is not None:
                shutil.rmtree(old)
        except OSError as error:
            warnings.warn(
                f"save_pretrained: {self.target} holds the new checkpoint, but tidying up after it failed "
                f"({type(error).__name__}: {error}); what is left of the directory it replaced is in {old}",
                stacklevel=4,
            )


def _prepare(target: str) -> tuple[str, str, int]:
    """Rank 0: check the target (a directory or nothing; never a link) and create the staging directory."""
    parent, name = os.path.split(target)
    if not name:
        raise PretrainedCheckpointError("not a directory to save into")
    os.makedirs(parent, exist_ok=True)
    try:
        seen = os.lstat(target)
    except FileNotFoundError:
        seen = None
    if seen is not None and stat.S_ISLNK(seen.st_mode):
        raise PretrainedCheckpointError(
            "a symbolic link; save_pretrained replaces the directory and never writes through a link: pass the "
            "directory it points to"
        )
    if seen is not None and not stat.S_ISDIR(seen.st_mode):
        raise PretrainedCheckpointError("exists and is not a directory")
    here = os.path.realpath(os.getcwd())
    if seen is not None and os.path.commonpath([here, os.path.realpath(target)]) == os.path.realpath(target):
        raise PretrainedCheckpointError(
            "holds the working directory, and a save replaces the directory whole: save into a subdirectory"
        )
    for leftover in sorted(n for n in os.listdir(parent) if n.startswith(f".{name}.saving-")):
        warnings.warn(
            f"{os.path.join(parent, leftover)}: left by a save_pretrained that did not finish (it holds a partial "
            "save, or the directory a save replaced); nothing reads it: remove it",
            stacklevel=4,
        )
    staging = os.path.join(parent, f".{name}.saving-{secrets.token_hex(6)}")
    os.mkdir(staging, 0o700)
    if seen is not None:
        return target, staging, stat.S_IMODE(seen.st_mode)
    probe = os.path.join(staging, ".mode")  # a directory made as usual (the umask's mode), in the private one
    os.mkdir(probe)
    mode = stat.S_IMODE(os.stat(probe).st_mode)
    os.rmdir(probe)
    return target, staging, mode


def _carry_over(target: str, staging: str, written: set[str]) -> list[str]:
    """The target's files this save does not replace, hard-linked into ``staging`` (links as links, never
    followed); its subdirectories' names, to move across after the swap."""
    folders = []
    for entry in os.scandir(target):
        if entry.name in written or entry.name in (SINGLE_NAME, INDEX_NAME) or _SHARDS.fullmatch(entry.name):
            continue  # the old checkpoint's weights: replaced, never left stale
        if entry.is_dir(follow_symlinks=False):
            folders.append(entry.name)
            continue
        source, copy = entry.path, os.path.join(staging, entry.name)
        try:
            os.link(source, copy, follow_symlinks=False)
        except OSError:  # no hard links here: a copy (a link copied as a link)
            if entry.is_symlink():
                os.symlink(os.readlink(source), copy)
            else:
                shutil.copy2(source, copy, follow_symlinks=False)
    return folders


def _swap(new: str, target: str) -> str:
    """Put ``new`` in ``target``'s place; where the old directory now is. One step where the file system can
    exchange two directories (Linux ``renameat2(RENAME_EXCHANGE)``); else two renames, and a save killed between
    them leaves the old checkpoint in ``<new>.replaced`` and the new one in ``new``, neither at the target."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(target), _RENAME_EXCHANGE) == 0:
            return new
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), target)
    old = f"{new}.replaced"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old, target)
        raise
    return old


def _fsync(path: str, flags: int) -> None:
    """Flush ``path`` to disk (a directory: its entries), opened without following a link."""
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
