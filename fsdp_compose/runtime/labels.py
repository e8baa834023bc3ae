"""Profiler labels: ``fsdp_compose::all_gather blocks.3`` around each collective step.

When no profiler runs, ``labelled`` costs one flag read and returns a shared null context,
so the hot path pays nothing measurable (see benchmarks/bench_overhead.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.profiler as _autograd_profiler

_NULL = contextlib.nullcontext()


def group_name(label: str) -> str:
    """The module FQN inside a group label (``'blocks.3' (Block)`` after lazy init); else the label."""
    if label.startswith("'"):
        end = label.find("'", 1)
        if end > 0:
            return label[1:end]
    return label


def labelled(kind: str, group) -> contextlib.AbstractContextManager:
    """``record_function("fsdp_compose::<kind> <module fqn>")`` while a profiler runs, else a no-op."""
    if not _autograd_profiler._is_profiler_enabled:
        return _NULL
    return torch.profiler.record_function(f"fsdp_compose::{kind} {group_name(group.label)}")
