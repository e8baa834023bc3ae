"""What of a model a checkpoint holds: its parameters and persistent buffers, each once under all its names.

A tied weight (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is one tensor with two names; a
checkpoint usually holds it under one of them. Non-persistent buffers (a rotary embedding's ``inv_freq``)
are not in checkpoints: the module computes them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class ModelTensor:
    names: list[str]  # every name it has in the model; the first is the one a save writes
    tensor: torch.Tensor


def checkpoint_tensors(model: nn.Module) -> list[ModelTensor]:
    """The parameters and persistent buffers of ``model``, in ``state_dict`` order, tied ones once."""
    by_id: dict[int, ModelTensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        tensors = [*module._parameters.items()]
        tensors += [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, tensor in tensors:
            if tensor is None:
                continue
            entry = by_id.setdefault(id(tensor), ModelTensor([], tensor))
            if dot + name not in entry.names:
                entry.names.append(dot + name)
    return list(by_id.values())


def non_persistent_buffers(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, name, full name)`` of each non-persistent buffer, once per owning module."""
    found, seen = [], set()
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set and (id(module), name) not in seen:
                seen.add((id(module), name))
                found.append((module, name, f"{prefix}.{name}" if prefix else name))
    return found
