"""``load_pretrained``: a Hugging Face safetensors checkpoint read straight into the shards.

Each rank reads the byte runs of its own rows of each tensor (one run for a ``Shard(0)`` parameter), converts
them to the parameter's dtype and copies them into its local shard, in place: no rank builds a full tensor or
a state dict. Everything is checked first, on every rank (the files, opened once through the checkpoint file
layer, their headers, the names, the shapes and, last, that no file changed since it was checked): an error
leaves the model untouched everywhere. Every byte is read from the descriptor that was checked, so a name swapped
for a link or a FIFO afterwards is never read through; a file truncated while being read raises on every rank,
saying the model holds part of it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...extras_api import raise_together, reshard_idle
from ..checkpoint.files import FileRefused
from . import peft
from .checkpoint_dir import open_checkpoint, refused
from .conversions import CheckpointLayout, Fused, from_checkpoint_layout, read_fused, remember_conversions
from .initialize import InitJob, initializer, module_jobs, run_jobs, unsupported
from .local_region import Region, region_of
from .model_tensors import ModelTensor, checkpoint_tensors, non_persistent_buffers
from .progress import progress_bar
from .safetensors_file import PretrainedCheckpointError, TensorEntry

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]

logger = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    """What ``load_pretrained`` found: model names the checkpoint lacked, checkpoint names the model lacks,
    and the bytes of tensor data this rank read."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    bytes_read: int


class _Plan(NamedTuple):
    loads: list[tuple[str, TensorEntry, Region]]  # by the tensor's first model name
    missing: list[str]
    unexpected: list[str]
    rebuild: list[tuple[nn.Module, str, str]]  # non-persistent buffers on meta, to compute again
    fused: list[tuple[str, Fused, Region]]  # conversions: a tensor made of several (experts' fused)
    conversions: CheckpointLayout
    inits: list[InitJob]  # a meta-built model: what the checkpoint does not hold, initialized by the model's way


@torch.no_grad()
def load_pretrained(
    model: nn.Module,
    path: str,
    *,
    strict: bool = True,
    key_map: KeyMap | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    progress: bool = True,
    init_missing: Callable[[nn.Module], None] | None = None,
) -> LoadResult:
    """Load the safetensors checkpoint at ``path`` (a directory with ``model.safetensors.index.json`` or
    ``model.safetensors``, or one ``.safetensors`` file) into ``model``, sharded or not, on every rank.

    A model still on ``meta`` (built there, then ``fully_shard``) is first materialized where its shards
    live, and its non-persistent buffers are computed as the module's own initialisation computes them: a
    Hugging Face model's ``_init_weights(module)``, else ``init_buffers(module)`` for each module owning one.
    ``key_map`` renames checkpoint names to the model's (a dict, or a callable returning ``None`` to skip
    a tensor); then a transformers model's names go through the conversions its ``from_pretrained`` applies
    (a mixture of experts' per-expert tensors fused into one parameter, each rank reading its experts only).
    ``strict`` raises on missing or unexpected names; otherwise they are returned and named in a warning, and a
    meta-built model's missing tensors are initialized as the model initializes them: each owning module's
    ``init_missing(module)``, else a Hugging Face model's ``_init_weights(module)``, else its
    ``reset_parameters()`` (at full size, each rank keeping its rows); a materialized model's keep their values.

    A peft model (LoRA adapters on the base layers) takes a base checkpoint under the base names
    (``q_proj.base_layer.weight`` reads ``q_proj.weight``); its adapters are not the checkpoint's and keep the
    values peft gave them (a meta-built model's LoRA adapters get peft's own initialisation).
    ``progress=False`` hides the progress bar rank 0 shows (with tqdm installed) once a load takes a few
    seconds; it counts the bytes rank 0 reads. The time and bytes each rank read are logged at INFO
    on the ``fsdp_compose`` logger.
    """
    began = time.perf_counter()
    # a group left unsharded (the root after a forward with grad and no backward) holds plain tensors the next
    # reshard would drop: the load goes into the shards, every group sharded first (refused during backward)
    reshard_idle(model, "load_pretrained")
    error, plan, checkpoint = None, None, None
    try:
        checkpoint = open_checkpoint(path)  # every file open and checked; its header read from that descriptor
        plan = _plan(model, checkpoint.tensors, key_map, init_buffers, init_missing, strict)
        if strict and (plan.missing or plan.unexpected):
            error = f"{path}: {_mismatch(plan.missing, plan.unexpected)}; pass key_map to rename, or strict=False"
        error = error or checkpoint.changed()  # the last check before a byte is written: every file as checked
    except (PretrainedCheckpointError, OSError, ValueError, NotImplementedError) as failure:
        error = str(failure)
    try:
        raise_together(error, cls=PretrainedCheckpointError)  # a file bad on one rank: none loads anything
        assert plan is not None
        bytes_read = _read_all(model, plan, init_buffers, progress)
    finally:
        if checkpoint is not None:
            checkpoint.close()
    if plan.missing and (not dist.is_initialized() or dist.get_rank() == 0):
        done = "initialized as the model initializes them" if plan.inits else "left with the values they had"
        warnings.warn(f"load_pretrained: {path} lacks {', '.join(plan.missing)}; {done}", stacklevel=3)
    if logger.isEnabledFor(logging.INFO):
        seconds = time.perf_counter() - began
        total = sum(entry.nbytes for _, entry, _ in plan.loads)
        mib, total_mib = bytes_read / 2**20, total / 2**20
        logger.info(
            "load_pretrained: %d tensors from %s in %.2f s; %s read %.1f MiB of their %.1f (%.0f MiB/s)",
            len(plan.loads), path, seconds, _this_rank(), mib, total_mib, mib / max(seconds, 1e-9),
        )
    return LoadResult(plan.missing, plan.unexpected, bytes_read)


def _this_rank() -> str:
    return f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"


def _read_all(model: nn.Module, plan: _Plan, init_buffers, progress: bool) -> int:
    """Materialize a model on meta, then read this rank's rows of every tensor into its shards; bytes read. A
    file that changes while it is read (after every check passed) raises on every rank."""
    _materialize(model, plan.rebuild, init_buffers)
    run_jobs(model, plan.inits)  # before the reads: a job writes whole modules, loaded tensors included
    now = {t.names[0]: t.tensor for t in checkpoint_tensors(model)}  # to_empty may have swapped tensors
    bytes_read, error = 0, None
    mine = sum(n for _, entry, region in plan.loads for *_, n in region.runs(entry.dtype.itemsize))
    mine += sum(_nbytes(fused) for _, fused, _ in plan.fused)  # fused experts: their sources' bytes, a bound
    with progress_bar(mine, "load_pretrained", enabled=progress) as bar:
        try:
            for name, entry, region in plan.loads:
                n = _read_into(_local(now[name]), entry, region)
                bytes_read += n
                bar.update(n)
            for name, fused, region in plan.fused:  # conversions: read only the sources of this rank's rows
                bytes_read += read_fused(_local(now[name]), region, fused, _read_into)
                bar.update(_nbytes(fused))
        except PretrainedCheckpointError as failure:
            error = f"{failure}; the model holds part of the checkpoint: load it again"
    raise_together(error, cls=PretrainedCheckpointError)
    remember_conversions(model, plan.conversions)
    return bytes_read


def _plan(
    model: nn.Module, found: dict[str, TensorEntry], key_map: KeyMap | None, init_buffers, init_missing, strict: bool
) -> _Plan:
    renamed: dict[str, TensorEntry] = {}
    for name, entry in found.items():
        new = key_map(name) if callable(key_map) else (key_map or {}).get(name, name)
        if new is None:
            continue
        if new in renamed:
            raise PretrainedCheckpointError(f"{entry.file}: tensors '{renamed[new].name}' and '{name}' both map to '{new}'")
        renamed[new] = entry
    bases, adapters = peft.split(model, checkpoint_tensors(model))  # a peft model: base names; adapters apart
    # conversions: from_pretrained's renamings, and tensors made of several (one per expert on disk)
    converted = from_checkpoint_layout(model, renamed, {name for t in bases for name in t.names})
    renamed = converted.renamed
    loads, fused, missing, known = [], [], [], set()
    for target in bases:
        known.update(target.names)
        name, tensor = target.model.names[0], target.model.tensor
        made = next((converted.fused[n] for n in target.names if n in converted.fused), None)
        if made is not None:
            if tuple(made.made_of.shape) != tuple(tensor.shape):
                raise PretrainedCheckpointError(
                    f"tensors {', '.join(made.entries)} make shape {list(made.made_of.shape)}, "
                    f"the model's '{name}' {list(tensor.shape)}"
                )
            fused.append((name, made, region_of(tensor, name)))
            continue
        entry = next((renamed[n] for n in target.names if n in renamed), None)
        if entry is None:
            missing.append(name)
            continue
        if entry.shape != tuple(tensor.shape):
            raise PretrainedCheckpointError(
                f"{entry.file}: tensor '{entry.name}' has shape {list(entry.shape)}, "
                f"the model's '{name}' {list(tensor.shape)}"
            )
        loads.append((name, entry, region_of(tensor, name)))
    loads.sort(key=lambda load: (load[1].file, load[1].begin))  # each file read front to back
    unexpected = sorted(set(renamed) - known)
    on_meta = [t.is_meta for t in (*model.parameters(), *model.buffers())]
    if any(on_meta) and not all(on_meta):
        raise PretrainedCheckpointError(
            "the model is partly on meta: materializing it (to_empty) would overwrite the values it already has; "
            "build it wholly on meta, or materialize it (to_empty, init_sharded_parameters) before load_pretrained"
        )
    inits = _init_jobs(model, missing if not strict else [], adapters, init_missing) if all(on_meta) else []
    rebuild = [b for b in non_persistent_buffers(model) if getattr(b[0], b[1]).is_meta]
    if rebuild and init_buffers is None and not hasattr(model, "_init_weights"):
        names = ", ".join(fqn for _, _, fqn in rebuild)
        raise PretrainedCheckpointError(
            f"non-persistent buffers {names} are on meta and no checkpoint holds them; pass "
            "init_buffers=fn(module) that computes them (what the module's __init__ does)"
        )
    return _Plan(loads, missing, unexpected, rebuild, fused, converted, inits)


def _nbytes(fused: Fused) -> int:
    return sum(entry.nbytes for entry in fused.entries.values())


def _init_jobs(model: nn.Module, missing: list[str], adapters: list[ModelTensor], init_missing) -> list[InitJob]:
    """What the load materializes and no checkpoint tensor fills: missing names by the model's own
    initialisation, a peft model's adapters by peft's; refused, naming them, where nothing can."""
    jobs, orphans = module_jobs(model, missing, initializer(model, init_missing))
    adapter_jobs, uninitialized = peft.adapter_init_jobs(model, adapters)
    if orphans:
        raise PretrainedCheckpointError(
            f"strict=False: the checkpoint lacks {', '.join(orphans)}, the model is on meta and has no way to "
            "initialize them (no _init_weights, no reset_parameters); pass init_missing=fn(module)"
        )
    if uninitialized:
        raise PretrainedCheckpointError(
            f"the model is on meta and its adapter tensors {', '.join(uninitialized)} can be initialized only by peft "
            "(LoRA with init_lora_weights True or 'gaussian'); use one of those, or build the peft model off meta"
        )
    bad = unsupported(model, jobs + adapter_jobs)
    if bad:
        raise PretrainedCheckpointError(
            f"cannot initialize {', '.join(bad)} at full size (tensor parallel); load a checkpoint that holds them"
        )
    return jobs + adapter_jobs


def _mismatch(missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected (not in the model): {', '.join(unexpected)}")
    return "; ".join(parts)


def _materialize(model: nn.Module, rebuild: list[tuple[nn.Module, str, str]], init_buffers) -> None:
    """A model on meta gets storage where its shards live, then its non-persistent buffers' values."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    model.to_empty(device=_shard_device(tensors))
    owners = list({id(module): module for module, _, _ in rebuild}.values())
    for module in owners:
        if init_buffers is not None:
            init_buffers(module)
        else:
            model._init_weights(module)  # a Hugging Face model's own initialisation of that module


def _shard_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device of the shards' mesh (``to_empty`` on a sharded model keeps CPU-offloaded shards on CPU)."""
    for t in tensors:
        if isinstance(t, DTensor) and t.device_mesh.device_type != "cpu":
            kind = t.device_mesh.device_type
            return torch.device(kind, torch.get_device_module(kind).current_device())
    return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _read_into(local: torch.Tensor, entry: TensorEntry, region: Region) -> int:
    """Read ``region`` of ``entry`` into ``local`` (this rank's part, converted to its dtype); bytes read."""
    runs = region.runs(entry.dtype.itemsize)
    nbytes = sum(n for _, _, n in runs)
    if not nbytes:
        return 0
    direct = local.dtype == entry.dtype and local.device.type == "cpu" and local.is_contiguous()
    buffer = local.detach().view(-1).view(torch.uint8) if direct else torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    try:
        for in_tensor, in_buffer, n in runs:  # from the descriptor the checks opened, never by name again
            entry.source.read_into(view[in_buffer : in_buffer + n], entry.begin + in_tensor)
    except (FileRefused, OSError) as error:
        raise refused(error, entry.file) from None
    if not direct:
        local.copy_(buffer.view(entry.dtype).view(region.local_shape))
    return nbytes

