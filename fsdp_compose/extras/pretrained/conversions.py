"""The conversions transformers applies between a checkpoint's layout and its model's, done straight into the
shards by ``load_pretrained`` and out of them by ``save_pretrained``.

transformers 5 keeps, per model, a list of ``WeightTransform``s (``transformers.conversion_mapping.
get_model_conversion_mapping``, what ``from_pretrained`` uses): ``WeightRenaming``s (Mixtral's
``block_sparse_moe`` is the model's ``mlp``) and ``WeightConverter``s, whose operations make one parameter of
several checkpoint tensors (a mixture of experts' fused ``mlp.experts.gate_up_proj`` of every expert's
``w1`` and ``w3``) and, reversed (``reverse_transform``), the checkpoint tensors of the parameter. Here the
names go through transformers' own functions (``rename_source_key``, ``apply_converters``,
``apply_renamings``), and the operations run on ``Layout``s (``layout.py``): a rank reads only the checkpoint
tensors of its own rows (the experts its shard holds), and writes only the parts of each expert it holds.
Models that are not transformers models, or transformers without these functions, are left as they are.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ... import FSDPModule

from .layout import Layout, Leaf, _UnsupportedConversion, full_box, slices
from .local_region import Region, region_of
from .model_tensors import ModelTensor
from .safetensors_file import PretrainedCheckpointError, TensorEntry


@dataclasses.dataclass
class Fused:
    """A model tensor made of several checkpoint tensors: ``made_of`` over the ``entries``' names."""

    made_of: Layout
    entries: dict[str, TensorEntry]


@dataclasses.dataclass
class CheckpointLayout:
    renamed: dict[str, TensorEntry]  # model name -> its one checkpoint tensor (names the model lacks kept as found)
    fused: dict[str, Fused]  # model name -> the checkpoint tensors it is made of
    used: list | None  # the transforms that matched (None: no transformers model), kept for a later save


def from_checkpoint_layout(model: nn.Module, found: dict[str, TensorEntry], model_names: set[str]) -> CheckpointLayout:
    """``found`` (checkpoint name -> tensor) as the model's names, through ``from_pretrained``'s conversions."""
    transforms = _transforms(model, for_save=False)
    if transforms is None:
        return CheckpointLayout(dict(found), {}, None)
    loading = _core()
    renamings, converters, by_pattern = _split(transforms)
    present = dict.fromkeys(model_names, True)  # what rename_source_key checks names against
    prefix = getattr(model, "base_model_prefix", None) or None
    renamed: dict[str, TensorEntry] = {}
    groups: dict[str, tuple[object, dict[str, TensorEntry]]] = {}
    for key in sorted(found, key=loading.dot_natural_key):  # from_pretrained's order: experts 0, 1, ..., 10
        new, pattern = loading.rename_source_key(key, renamings, converters, prefix, present)
        if new not in present and key in present:
            new, pattern = loading.rename_source_key(key, [], [], prefix, present)
        if pattern is None or new not in present:
            new = new if new in present else key  # a name the model lacks: reported under the checkpoint's name
            if new in renamed or new in groups:
                raise PretrainedCheckpointError(f"{found[key].file}: tensor '{key}' and another both map to '{new}'")
            renamed[new] = found[key]
            continue
        if new in renamed:
            raise PretrainedCheckpointError(f"{found[key].file}: tensor '{key}' and another both map to '{new}'")
        converter, entries = groups.setdefault(new, (copy.deepcopy(by_pattern[pattern]), {}))
        converter.add_tensor(new, key, pattern, Leaf(key, found[key].shape))
        entries[key] = found[key]
    fused: dict[str, Fused] = {}
    for first, (converter, entries) in groups.items():
        for name, layout in _convert(converter, first, model, entries).items():
            if name not in present or name in renamed or name in fused:
                raise PretrainedCheckpointError(
                    f"{_files(entries)}: tensors {_names(entries)} convert to '{name}', which the model lacks or has twice"
                )
            fused[name] = Fused(layout, entries)
    return CheckpointLayout(renamed, fused, [t for t in transforms if t.was_used()])


def remember_conversions(model: nn.Module, layout: CheckpointLayout) -> None:
    """What ``from_pretrained`` keeps on the model: the transforms its checkpoint used, which a save reverses."""
    if layout.used is not None:
        model._weight_conversions = layout.used


def read_fused(local: torch.Tensor, region: Region, fused: Fused, read_into: Callable) -> int:
    """Read the checkpoint tensors' parts of ``region`` into ``local`` (this rank's part); bytes read.
    ``read_into(tensor, entry, region)`` is ``load.py``'s reader: ``region`` of ``entry`` into ``tensor``."""
    nbytes = 0
    for piece in fused.made_of.pieces(region.box):
        entry = fused.entries[piece.source]
        part = torch.empty([size for _, size in piece.source_box], dtype=local.dtype)
        nbytes += read_into(part, entry, Region(entry.shape, piece.source_box, writer=True))
        local[slices(piece.box, region.box)].copy_(piece.arrange(part))
    return nbytes


@dataclasses.dataclass
class ConvertedTensor(ModelTensor):
    """A checkpoint tensor made of model tensors (one expert's ``w1`` out of a fused ``gate_up_proj``). Its
    ``tensor`` is on meta (the shape and dtype the file holds); ``made_of`` is over ``sources``' names."""

    made_of: Layout | None = None
    sources: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    gathered: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # shared: the full source, on CPU
    last: bool = True  # the last tensor made of its sources: what ``whole`` gathered is dropped after it

    def rows(self, rank: int) -> Iterator[tuple[int, memoryview]]:
        """``(byte offset in the tensor, bytes)`` of each run this rank writes: the parts its shards hold."""
        itemsize = self.tensor.dtype.itemsize
        for piece in self.made_of.pieces(full_box(self.tensor.shape)):
            source = self.sources[piece.source]
            region = region_of(source, piece.source)
            if not region.writer or (not isinstance(source, DTensor) and rank != 0):
                continue
            part = piece.within(region.box)
            if part is None:
                continue
            local = source.to_local() if isinstance(source, DTensor) else source
            values = part.arrange(local.detach()[slices(part.source_box, region.box)])
            data = values.to("cpu", self.tensor.dtype).contiguous().view(-1).view(torch.uint8).numpy()
            for in_tensor, in_data, n in Region(tuple(self.tensor.shape), part.box, writer=True).runs(itemsize):
                yield in_tensor, memoryview(data)[in_data : in_data + n]

    def whole(self) -> torch.Tensor:
        """The whole tensor, on every rank: its sources are gathered (``full_tensor``, a collective) once for all
        the checkpoint tensors made of them, and dropped after the last."""
        out = torch.empty(self.tensor.shape, dtype=self.tensor.dtype)
        for piece in self.made_of.pieces(full_box(self.tensor.shape)):
            source = self.sources[piece.source]
            if id(source) not in self.gathered:
                full = source.full_tensor() if isinstance(source, DTensor) else source
                self.gathered[id(source)] = full.detach().to("cpu")
            full = self.gathered[id(source)]
            values = full[slices(piece.source_box, full_box(full.shape))]
            out[slices(piece.box, full_box(out.shape))] = piece.arrange(values)
        if self.last:
            self.gathered.clear()
        return out


def to_checkpoint_layout(model: nn.Module, tensors: list[ModelTensor]) -> list[ModelTensor]:
    """The tensors ``save_pretrained`` writes, named and laid out as transformers' ``save_pretrained`` writes
    them (``revert_weight_conversion``): renamed, and the fused ones as the checkpoint tensors they came from."""
    transforms = _transforms(model, for_save=True)
    if not transforms:
        return tensors
    loading = _core()
    reverse = [t.reverse_transform() for t in transforms[::-1]]  # submodels' conversions first, as transformers
    renamings, converters, by_pattern = _split(reverse)
    groups: dict[str, object] = {}
    group_of: dict[int, str] = {}
    sources: dict[str, dict[str, torch.Tensor]] = {}
    for target in sorted(tensors, key=lambda t: loading.dot_natural_key(t.names[0])):
        name = target.names[0]
        new, pattern = loading.apply_converters(name, converters)
        if pattern is not None:
            converter = groups.setdefault(new, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(new, name, pattern, Leaf(name, target.tensor.shape))
            sources.setdefault(new, {})[name] = target.tensor
            group_of[id(target)] = new
    out: list[ModelTensor] = []
    for target in tensors:  # in the model's order; a group's tensors where its first member was
        group = group_of.get(id(target))
        if group is None:
            name = loading.apply_renamings(target.names[0], renamings)
            out.append(target if name == target.names[0] else ModelTensor([name], target.tensor))
        elif group in groups:
            members, gathered = sources[group], {}  # gathered: one group's full sources, in a save that gathers
            dtype = next(iter(members.values())).dtype
            for name, made_of in _convert(groups.pop(group), group, model, members).items():
                meta = torch.empty(made_of.shape, dtype=dtype, device="meta")
                name = loading.apply_renamings(name, renamings)
                out.append(ConvertedTensor([name], meta, made_of, members, gathered, last=False))
            out[-1].last = True
    return out


def _convert(converter, first: str, model: nn.Module, members: dict) -> dict[str, Layout]:
    """A converter's operations run on ``Layout``s: ``{name: layout}``."""
    ops = ", ".join(type(op).__name__ for op in getattr(converter, "operations", []))
    what = f"'{first}' from {_names(members)}"
    try:
        outputs = converter.convert(first, model=model, config=getattr(model, "config", None))
    except (_UnsupportedConversion, AttributeError) as error:
        raise NotImplementedError(
            f"{what}: transformers converts them with {ops}, which needs the values ({error}); "
            "load_pretrained/save_pretrained move data only (stack, cat, chunk, split, transpose)"
        ) from None
    except (ValueError, IndexError) as error:
        raise PretrainedCheckpointError(f"{_files(members)}: {what} do not convert with {ops}: {error}") from None
    converted = {name: value[0] if isinstance(value, list) else value for name, value in outputs.items()}
    if not all(isinstance(value, Layout) for value in converted.values()):
        raise NotImplementedError(f"{what}: transformers' {ops} made something other than tensors")
    return converted


def _files(members: dict) -> str:
    return ", ".join(sorted({e.file for e in members.values() if isinstance(e, TensorEntry)})) or "the model"


def _names(members: dict) -> str:
    names = list(members)
    return ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _split(transforms: list) -> tuple[list, list, dict]:
    loading = _core()
    renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
    return renamings, converters, {pattern: c for c in converters for pattern in c.source_patterns}


def _core():
    from transformers import core_model_loading

    return core_model_loading


def _transforms(model: nn.Module, for_save: bool) -> list | None:
    """transformers' transforms for ``model`` (those ``from_pretrained`` applies, or for a save those it
    reverses), or ``None`` for a model that is not a transformers model."""
    if "transformers" not in sys.modules:  # a transformers model was built, so transformers is imported
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: no conversions
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    if for_save and getattr(model, "_weight_conversions", None) is not None:
        return list(model._weight_conversions)  # what its load used (from_pretrained's or load_pretrained's)
    with _own_classes(model):
        transforms = get_model_conversion_mapping(model, add_legacy=not for_save)
    if for_save:  # as transformers' revert_weight_conversion for a model not loaded from a checkpoint
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    return transforms


@contextlib.contextmanager
def _own_classes(model: nn.Module) -> Iterator[None]:
    """transformers looks conversions up by class name first (``GPTNeoXForCausalLM``): for that call, sharded
    modules are seen as their own class, not the ``FSDP...`` subclass ``fully_shard`` swapped in."""
    swapped = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            own = next(c for c in type(module).__bases__ if not issubclass(c, FSDPModule))  # (FSDPModule, own)
            swapped.append((module, type(module)))
            module.__class__ = own
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
