"""Flat checkpoint keys, and the check of a checkpoint's metadata against what will load into it.

Everything a checkpoint holds is addressed by one flat key ("model.blocks.0.fc1.weight",
"optim.state.embed.weight.exp_avg", "meta.step"), so a mismatch can be reported by name and
found before a single byte is read into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .errors import CheckpointError


def map_leaves(tree: Any, fn: Callable[[str, Any], Any], prefix: str = "") -> Any:
    """Rebuild nested dicts/lists with every leaf replaced by ``fn(flat_key, leaf)``."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(v, fn, f"{prefix}.{i}") for i, v in enumerate(tree)]
    return fn(prefix, tree)


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
    """``{flat_key: leaf}``; raises if two paths collide on one key."""
    flat: dict[str, Any] = {}

    def visit(key: str, leaf: Any) -> Any:
        if key in flat:
            raise CheckpointError(f"two entries of the state share the checkpoint key {key!r}")
        flat[key] = leaf
        return leaf

    map_leaves(tree, visit)
    return flat


def _describe(md: object) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"tensor of shape {tuple(md.size)} and dtype {md.properties.dtype}"
    return "non-tensor value"


def mismatches(expected: dict[str, Any], metadata: Metadata, prefixes: tuple[str, ...]) -> list[str]:
    """What keeps ``metadata`` from loading exactly into ``expected``, one line per key.

    Keys of the checkpoint under ``prefixes`` that nothing expects are reported too: a
    checkpoint of another model must not load "partly".
    """
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in expected.items():
        md = stored.get(key)
        if md is None:
            problems.append(f"missing key {key!r}")
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"key {key!r}: the model has a tensor, the checkpoint a {_describe(md)}")
            elif tuple(md.size) != tuple(value.shape):
                problems.append(
                    f"key {key!r}: shape {tuple(md.size)} in the checkpoint, {tuple(value.shape)} in the model"
                )
            elif md.properties.dtype != value.dtype:
                problems.append(
                    f"key {key!r}: dtype {md.properties.dtype} in the checkpoint, {value.dtype} in the model"
                )
        elif not isinstance(md, BytesStorageMetadata):
            problems.append(f"key {key!r}: the model has a non-tensor value, the checkpoint a {_describe(md)}")
    for key in stored:
        if key.startswith(prefixes) and key not in expected:
            problems.append(f"unexpected key {key!r} (in the checkpoint, not in the model / optimizer)")
    return problems


def format_problems(path: str, problems: list[str], limit: int = 12) -> str:
    shown = "\n  ".join(problems[:limit])
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"checkpoint {path!r} does not match what it is loaded into (nothing was loaded):\n  {shown}{more}"
