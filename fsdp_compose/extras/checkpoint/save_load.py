"""Atomic, resharding checkpoints of a model and its optimizer on ``torch.distributed.checkpoint``.

A save writes into ``.<name>.partial`` next to ``path``; when every rank has finished, rank 0
moves the previous checkpoint aside to ``.<name>.previous``, renames the new one into place and
only then deletes the previous one. A rank dying mid-save therefore leaves the previous
checkpoint where it was. A load checks the checkpoint's metadata against the model and
optimizer first and reads into scratch tensors, so a mismatched or corrupt checkpoint raises
``CheckpointError`` naming the key and leaves the model untouched. The state is saved sharded
(DTensors), so a checkpoint loads at any world size. Every rank must see the same directory.
Each file's CRC-32 is recorded in ``checksums.json`` and verified before a load
(``integrity.py``); ``load_checkpoint(..., fallback=True)`` then uses the previous
checkpoint, which a save keeps unless ``keep_previous=False``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...extras_api import raise_together, reshard_idle
from . import integrity
from .errors import CheckpointError
from .keys import flatten, format_problems, map_leaves, mismatches
from .files import METADATA, check_payload
from .reader import CheckedReader
from .safety import MAX_DEPTH, SafeLoadPlanner, load_plain, not_plain

logger = logging.getLogger(__name__)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.previous")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(path: Path, partial: Path, previous: Path, keep_previous: bool) -> None:
    """Rank 0: put the complete new checkpoint in place, keeping the old one until then."""
    if path.exists():
        if previous.exists():
            shutil.rmtree(previous)
        path.rename(previous)
    (partial / integrity.OWNER).unlink(missing_ok=True)
    partial.rename(path)
    _fsync_dir(path.parent)
    if previous.exists() and not keep_previous:
        shutil.rmtree(previous)


def _on_rank0_then_all(work: Callable[[], None], what: str) -> None:
    """Run file work on rank 0; if it fails, every rank raises (none is left at a barrier)."""
    failure = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as error:  # noqa: BLE001 - reported to every rank below
            failure = f"save_checkpoint failed while {what} on rank 0: {type(error).__name__}: {error}"
    raise_together(failure, cls=CheckpointError, source=0)


def exists(path: str | os.PathLike) -> bool:
    """Whether ``load_checkpoint(path, ...)`` finds a checkpoint (the previous one included)."""
    try:
        resolve(path)
    except CheckpointError:
        return False
    return True


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: Any = None,
    keep_previous: bool = True,
) -> None:
    """Save model and optimizer state (sharded), ``step`` and ``extra`` atomically to ``path``.

    Call on every rank. ``extra`` is plain data, the same on every rank (e.g. a data loader
    position or an LR scheduler's ``state_dict()``): dicts, lists, tuples, strings, numbers,
    booleans, None and tensors, what ``torch.load(weights_only=True)`` admits, so loading it runs no
    code; anything else raises ``CheckpointError`` naming where in ``extra`` it sits.
    ``keep_previous`` keeps the checkpoint this one replaces as ``.<name>.previous`` for
    ``load_checkpoint(fallback=True)``.
    """
    began = time.perf_counter()
    path = Path(path)
    partial, previous = _siblings(path)
    found = not_plain(extra)
    if found is not None:
        raise CheckpointError(
            f"save_checkpoint: {found}; extra holds plain data only (dicts, lists, tuples, strings, numbers, "
            f"booleans, None, tensors; containers at most {MAX_DEPTH} deep), so that loading a checkpoint never runs "
            "code; store such an object's state (e.g. its state_dict()) instead"
        )
    reshard_idle(model, "save_checkpoint")
    flat = flatten(_state(model, optimizer))
    flat["meta.step"] = step
    blob = io.BytesIO()
    torch.save(extra, blob)
    flat["meta.extra"] = blob.getvalue()  # one opaque leaf (DCP would split a dict into keys), torch.save's zip

    def prepare() -> None:
        if partial.exists():
            if not integrity.stale(partial):
                raise CheckpointError(f"{str(partial)!r} belongs to a save still running")
            shutil.rmtree(partial)  # left by an interrupted save
        partial.mkdir(parents=True)
        integrity.claim(partial)

    try:
        _on_rank0_then_all(prepare, "preparing")
        dcp.save(flat, checkpoint_id=partial)
        dist.barrier()  # every rank's files are written
        manifest = integrity.record_checksums(partial)
        _on_rank0_then_all(lambda: integrity.write_manifest(partial, manifest), "recording checksums")
        _on_rank0_then_all(lambda: _publish(path, partial, previous, keep_previous), "publishing")
    finally:
        integrity.release(partial)
    if dist.get_rank() == 0:
        logger.info("save_checkpoint: step %d saved to %s in %.2f s", step, path, time.perf_counter() - began)


def resolve(path: str | os.PathLike) -> Path:
    """``path``, or the previous checkpoint if a save died between its two renames."""
    path = Path(path)
    if not path.exists():
        _, previous = _siblings(path)
        if previous.exists():
            return previous
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    return path


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    fallback: bool = False,
    allow_pickled_extra: bool = False,
) -> tuple[int, Any]:
    """Load what ``save_checkpoint`` wrote, at any world size; return ``(step, extra)``.

    Call on every rank. Every file's checksum is verified first: a flipped byte, a truncated
    or a missing file raises ``CheckpointError`` naming the file, or, with ``fallback=True``,
    warns and loads the previous checkpoint (``.<name>.previous``) if that one verifies.
    The model and the optimizer's state values are changed only if the whole checkpoint fits
    and reads cleanly; a fresh optimizer may have had its state initialized (torch's
    ``get_optimizer_state_dict`` does so) before a refused load.

    Loading runs no code from the files: DCP's metadata and every value are read through an
    allowlist of plain data (docs/checkpointing.md), and a crafted file raises ``CheckpointError``
    naming it. It reads only the checkpoint's own regular files, by bare name, within their sizes,
    and inflates no compressed record (``files.py``), so its memory is bounded by what is on disk.
    Checkpoints of fsdp_compose before 0.1.1 pickled ``extra``; such a checkpoint loads only
    with ``allow_pickled_extra=True``, which unpickles it and so runs whatever it names: pass it
    only for a checkpoint you trust. A checkpoint ``torch.distributed.checkpoint.save`` wrote (its
    state under "model" and, optionally, "optim"; no checksums) loads as ``(0, None)``.
    """
    began = time.perf_counter()
    where = resolve(path)
    if where != Path(path) and _rank0():
        logger.info("load_checkpoint: %s is missing (a save stopped between its renames): loading %s", path, where)
    if _maybe_written_by_torch_dcp(where):
        metadata = integrity.verify(where, checksums=False)  # every file-layer check but the checksums
        if "meta.step" not in metadata.state_dict_metadata:  # else one of ours that lost its checksums
            return _load_dcp(where, metadata, model, optimizer)
    try:
        metadata = integrity.verify(where)
    except CheckpointError as error:
        _, previous = _siblings(Path(path))
        if not fallback or where == previous or not previous.exists():
            raise
        warnings.warn(f"{error}\nloading the previous checkpoint {str(previous)!r} instead", stacklevel=2)
        where = previous
        metadata = integrity.verify(where)
    staged, template = _read(where, metadata, model, optimizer, {"meta.step": 0, "meta.extra": b""})
    extra = _extra(staged["meta.extra"], str(where), allow_pickled_extra)  # before anything changes
    _apply(model, optimizer, map_leaves(template, lambda key, _: staged[key]))
    if _rank0():
        seconds = time.perf_counter() - began
        logger.info("load_checkpoint: step %d loaded from %s in %.2f s", staged["meta.step"], where, seconds)
    return staged["meta.step"], extra


def _read(where: Path, metadata, model: nn.Module, optimizer, meta: dict[str, Any]) -> tuple[dict, dict]:
    """Check the checkpoint's (verified) metadata against the model (and optimizer), then read it all
    into scratch tensors through the allowlist: (what was read by flat key, the state's template)."""
    reshard_idle(model, "load_checkpoint")
    template = _state(model, optimizer)
    flat = {**flatten(template), **meta}
    prefixes = ("model.", "optim.") if optimizer is not None else ("model.",)
    problems = mismatches(flat, metadata, prefixes)
    if problems:
        raise CheckpointError(format_problems(str(where), problems))
    staged = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    _dcp_load(staged, where, metadata)
    return staged, template


def _dcp_load(staged: dict, where: Path, metadata) -> None:
    """DCP's load into the scratch ``staged``, through the file layer and the allowlist; a failure on any
    rank raises on every rank, naming each failing rank's key and file."""
    try:
        dcp.load(staged, storage_reader=CheckedReader(where, metadata), planner=SafeLoadPlanner())
    except CheckpointException as error:  # DCP gathered every rank's failure; a BaseException
        failures = "\n  ".join(f"rank {rank}: {failure[0]}" for rank, failure in sorted(error.failures.items()))
        raise CheckpointError(f"reading checkpoint {str(where)!r} failed; nothing was loaded:\n  {failures}") from None
    except Exception as error:  # noqa: BLE001 - before DCP's collectives: the same on every rank
        raise CheckpointError(f"reading checkpoint {str(where)!r} failed; nothing was loaded: {error}") from error


def _apply(model: nn.Module, optimizer, state: dict) -> None:
    """Copy what was read (nested as ``_state`` builds it) into the model and optimizer."""
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _extra(blob: bytes, where: str, allow_pickled: bool) -> Any:
    """``extra`` from its stored bytes: torch.save's zip of plain data, or an older save's pickle."""
    if blob[:2] == b"PK":
        check_payload(blob, f"value 'meta.extra' (extra) of checkpoint {where!r}")
        return load_plain(blob, f"'meta.extra' (extra) of checkpoint {where!r}")
    if not allow_pickled:
        raise CheckpointError(
            f"checkpoint {where!r} stores extra as a pickle (fsdp_compose before 0.1.1), and unpickling runs "
            "whatever code the file names; if you trust this checkpoint, load it knowingly with "
            "load_checkpoint(..., allow_pickled_extra=True), then save it again to store extra as plain data"
        )
    return pickle.loads(blob)  # noqa: S301 - the caller's explicit opt-in for a checkpoint it trusts


def _maybe_written_by_torch_dcp(where: Path) -> bool:
    """Metadata and no checksums (not even a link named so): torch.distributed.checkpoint.save's output,
    unless its metadata has our step (one of ours that lost its checksums)."""
    return not os.path.lexists(where / integrity.MANIFEST) and os.path.lexists(where / METADATA)


def _load_dcp(where: Path, metadata, model: nn.Module, optimizer) -> tuple[int, Any]:
    """A checkpoint torch.distributed.checkpoint.save wrote: no checksums to verify, no step or extra."""
    warnings.warn(
        f"{str(where)!r} has no {integrity.MANIFEST}: loading it as a torch.distributed.checkpoint checkpoint, "
        "without checksums (still through the file checks and the allowlist)",
        stacklevel=3,
    )
    reshard_idle(model, "load_checkpoint")
    # staged copies in DCP's own layout (it keeps a list of names as one value, where ours splits it)
    staged = map_leaves(_state(model, optimizer), lambda _, v: torch.empty_like(v) if torch.is_tensor(v) else v)
    _dcp_load(staged, where, metadata)
    _apply(model, optimizer, staged)
    return 0, None
