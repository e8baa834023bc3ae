"""Find every tensor in a module's output, dataclasses included.

pytree does not look inside dataclass instances (unless registered), so a module returning
``Out(value=tensor)`` would hide its tensors from the pre-backward hook, and backward would
reach freed parameters. This walks pytree containers and dataclass fields alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves


def is_tensor_leaf(x: object) -> bool:
    """A tensor pytree treats as a leaf (a tensor subclass could register itself as a node)."""
    return isinstance(x, torch.Tensor) and type(x) not in SUPPORTED_NODES


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    if is_tensor_leaf(output):  # fast paths: a module's usual outputs skip the pytree walk
        yield output
        return
    if type(output) is tuple and all(is_tensor_leaf(x) for x in output):
        yield from output
        return
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from output_tensors(getattr(leaf, field.name))
