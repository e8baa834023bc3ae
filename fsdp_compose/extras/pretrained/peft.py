"""peft models: a base checkpoint loaded under peft's names, adapters saved as ``PeftModel.save_pretrained``
writes them, or merged into the base weights.

peft wraps each targeted layer: ``q_proj.weight`` becomes ``q_proj.base_layer.weight`` beside the adapter's
``q_proj.lora_A.default.weight``; ``modules_to_save`` keeps ``lm_head.original_module`` and a trainable copy
``lm_head.modules_to_save.default``; a ``PeftModel`` holds the base model under ``base_model.model``. A base
checkpoint's names are the model's with those steps removed. Every other tensor of a tuner layer (or outside the
base model: a prompt encoder) is an adapter's, which a base load never touches. peft is imported only where a
model already holds its classes.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...extras_api import user_class
from .initialize import InitJob, full_size
from .local_region import region_of
from .model_tensors import ModelTensor

ADAPTER_FILE = "adapter_model.safetensors"


@dataclasses.dataclass
class BaseTensor:
    """A tensor a base checkpoint holds: its model names, its names in the base checkpoint, and which copy it
    is: ``"base"``, ``"original"`` (a ``modules_to_save`` wrapper's original) or ``"copy:<adapter>"``."""

    model: ModelTensor
    names: list[str]
    kind: str


def _classes() -> tuple[type, type, type] | None:
    """peft's ``PeftModel``, ``BaseTunerLayer`` and ``AuxiliaryTrainingWrapper``, if the program imported peft."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return PeftModel, BaseTunerLayer, AuxiliaryTrainingWrapper


def is_peft_model(model: nn.Module) -> bool:
    classes = _classes()
    return classes is not None and isinstance(model, classes[0])


def holds_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds peft layers (a ``PeftModel``, or adapters injected into a plain model)."""
    classes = _classes()
    return classes is not None and any(isinstance(m, classes[1:]) for m in model.modules())


def base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if is_peft_model(model) else model


def split(model: nn.Module, tensors: list[ModelTensor]) -> tuple[list[BaseTensor], list[ModelTensor]]:
    """``tensors`` (``checkpoint_tensors(model)``) as the base tensors, under base checkpoint names, and the
    adapters'. A model without peft layers is all base, under its own names."""
    if not holds_adapters(model):
        return [BaseTensor(t, list(t.names), "base") for t in tensors], []
    _, tuner, wrapper = _classes()
    modules = dict(model.named_modules(remove_duplicate=False))
    base = base_model(model)
    prefix = next(path for path, m in modules.items() if m is base)
    bases, adapters = [], []
    for t in tensors:
        found = [_base_name(name, prefix, modules, tuner, wrapper) for name in t.names]
        names = list(dict.fromkeys(name for _, name in found if name is not None))
        if names:
            bases.append(BaseTensor(t, names, next(kind for kind, name in found if name is not None)))
        else:
            adapters.append(t)
    return bases, adapters


def _base_name(name: str, prefix: str, modules: dict, tuner: type, wrapper: type) -> tuple[str, str | None]:
    """``(kind, name in a base checkpoint)`` of the model name ``name``; ``None`` for an adapter's tensor."""
    if prefix and not name.startswith(prefix + "."):
        return "adapter", None  # outside the base model (a prompt encoder)
    parts = name[len(prefix) + 1 :].split(".") if prefix else name.split(".")
    path, kept, kind, i = prefix, [], "base", 0
    while i < len(parts) - 1:
        module, part = modules[path], parts[i]
        path = f"{path}.{part}" if path else part
        if isinstance(module, tuner):
            if part != "base_layer":
                return "adapter", None
        elif isinstance(module, wrapper):
            if part == "modules_to_save":
                i += 1
                path, kind = f"{path}.{parts[i]}", f"copy:{parts[i]}"
            elif part == "original_module":
                kind = "original"
            else:
                return "adapter", None  # a trainable-tokens delta
        else:
            kept.append(part)
        i += 1
    return kind, ".".join([*kept, parts[-1]])


def adapter_init_jobs(model: nn.Module, adapters: list[ModelTensor]) -> tuple[list[InitJob], list[str]]:
    """For a model materialized by the load: peft's own reset of each LoRA adapter (``init_lora_weights`` True
    or ``"gaussian"``: values that need no base weights), and the adapter tensors nothing here can initialize."""
    if not adapters:
        return [], []
    from peft.tuners.lora import LoraLayer

    wanted = {id(t.tensor): t.names[0] for t in adapters}
    jobs, covered = [], set()
    configs = getattr(model, "peft_config", {})
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.lora_A.keys():
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            slots = [(m, n) for sub in (layer.lora_A[adapter], layer.lora_B[adapter]) for m in sub.modules()
                     for n, p in m._parameters.items() if p is not None and id(p) in wanted]
            if init not in (True, "gaussian") or adapter in getattr(layer, "lora_variant", {}) or not slots:
                continue
            jobs.append(InitJob(lambda l=layer, a=adapter, i=init: l.reset_lora_parameters(a, i), slots,
                                [wanted[id(m._parameters[n])] for m, n in slots]))
            covered.update(id(m._parameters[n]) for m, n in slots)
    return jobs, [name for i, name in wanted.items() if i not in covered]


def adapter_files(model: nn.Module, tensors: list[ModelTensor]) -> list[tuple[str, list[ModelTensor]]]:
    """Per adapter, its folder (``""`` for ``default``, else its name, as peft saves) and its tensors under the
    names ``get_peft_model_state_dict`` gives them, each one of the model's own tensors."""
    from peft.utils import get_peft_model_state_dict

    if not is_peft_model(model):
        raise ValueError(
            "save_pretrained: the model holds peft adapter layers but is not a PeftModel, so its adapter "
            "configuration is unknown; pass the PeftModel (get_peft_model's result), or merge_adapters=True"
        )
    state = model.state_dict(keep_vars=True)  # the model's own tensors, by identity
    by_id = {id(t.tensor): t for t in tensors}
    files = []
    for adapter in model.peft_config:
        named = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
        made = [key for key, value in named.items() if id(value) not in by_id]
        if made:
            raise ValueError(
                f"save_pretrained: peft computes {', '.join(made)} of adapter '{adapter}' "
                f"({model.peft_config[adapter].peft_type}) from the model rather than holding it; "
                "save_pretrained writes only tensors the model holds. Nothing was written"
            )
        members = [ModelTensor([key], by_id[id(value)].tensor) for key, value in named.items()]
        files.append(("" if adapter == "default" else adapter, members))
    return files


def write_adapter_configs(model: nn.Module, path: str) -> None:
    """``adapter_config.json`` of each adapter and peft's README, as ``PeftModel.save_pretrained`` writes them
    (the base class named by the user's class, not ``fully_shard``'s subclass). Rank 0 only."""
    model.create_or_update_model_card(path)
    base_cls = user_class(type(model.get_base_model()))
    for adapter, config in model.peft_config.items():
        config = copy.deepcopy(config)
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path") or None
        config.inference_mode = True
        auto = {"base_model_class": base_cls.__name__, "parent_library": base_cls.__module__}
        auto = auto if config.task_type is None else None  # peft maps the class only without a task type
        config.save_pretrained(path if adapter == "default" else os.path.join(path, adapter), auto_mapping_dict=auto)


def merged_tensors(model: nn.Module, bases: list[BaseTensor]) -> list[ModelTensor]:
    """The base model's tensors under its own names, each LoRA layer's active adapters added into its weight
    (``weight + delta.to(weight.dtype)`` per adapter, as peft's merge) and each ``modules_to_save`` wrapper's
    active copy in place of its original. Refuses what it cannot merge, naming it; changes nothing."""
    _, tuner, wrapper = _classes()
    from peft.tuners.lora import LoraLayer

    refused = "save_pretrained(merge_adapters=True): {} cannot be merged here; nothing was written"
    prompts = [a for a, c in getattr(model, "peft_config", {}).items() if c.is_prompt_learning]
    if prompts:
        raise ValueError(refused.format(f"prompt-learning adapters {prompts} (no weights to merge into)"))
    deltas: dict[int, list[tuple[nn.Module, str]]] = {}
    runs: dict[str, str | None] = {}  # a modules_to_save wrapper's path -> the copy it runs
    for path, module in model.named_modules():
        if isinstance(module, tuner):
            # the active adapters this layer holds (an adapter may target other layers only), as peft's merge
            held = [a for a in module.active_adapters if a in module._get_available_adapters()]
            plain = isinstance(module, LoraLayer) and not module.merged_adapters and all(
                a in module.lora_A and a not in module.lora_variant and not module.lora_bias[a] for a in held
            )
            if not plain:
                raise ValueError(refused.format(
                    f"'{path}' ({type(module).__name__}, adapters {held}: only plain LoRA on a weight, not DoRA "
                    "or other variants, lora_bias, embeddings, other tuners, or adapters merged already)"
                ))
            deltas[id(module.get_base_layer().weight)] = [(module, a) for a in held]
        elif isinstance(module, wrapper):
            if type(module).__name__ != "ModulesToSaveWrapper":
                raise ValueError(refused.format(f"'{path}' ({type(module).__name__})"))
            runs[path] = next(iter(module.active_adapters), None)
    out = []
    for b in bases:
        if not _runs(b, runs):
            continue
        tensor = b.model.tensor
        for layer, adapter in deltas.get(id(tensor), []):
            tensor = _plus_delta(tensor, layer, adapter, b.names[0])
        out.append(ModelTensor(b.names, tensor))
    names = [n for t in out for n in t.names]
    if len(names) != len(set(names)):
        shared = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(refused.format(f"a model whose tensors share the names {shared}"))
    return out


def _runs(b: BaseTensor, runs: dict[str, str | None]) -> bool:
    """Whether the merged model holds ``b``: a base tensor, a wrapper's original while it runs no copy, or the
    copy it runs."""
    if b.kind == "base":
        return True
    copy_name = b.kind.removeprefix("copy:") if b.kind != "original" else None
    marker = ".original_module." if copy_name is None else f".modules_to_save.{copy_name}."
    name = next(n for n in b.model.names if marker in n)
    return runs.get(name.split(marker)[0]) == copy_name


def _plus_delta(weight: torch.Tensor, layer: nn.Module, adapter: str, name: str) -> torch.Tensor:
    """``weight + layer.get_delta_weight(adapter)``, computed on the adapter's full (small) tensors and added
    to this rank's rows of the weight only: a DTensor of the weight's placements."""
    subs = (layer.lora_A[adapter], layer.lora_B[adapter])
    slots = [(m, n) for sub in subs for m in sub.modules() for n in m._parameters]
    with torch.no_grad(), full_size(slots, fill=lambda shard: shard.full_tensor()):
        delta = layer.get_delta_weight(adapter)
    if not isinstance(weight, DTensor):
        return weight.detach() + delta.to(weight.dtype)
    box = region_of(weight, name).box
    rows = delta[tuple(slice(start, start + size) for start, size in box)]
    local = weight.to_local() + rows.to(weight.dtype)
    return DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
    )
