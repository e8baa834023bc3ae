"""The two scopes a group enters around its collectives, both cheap on the hot path.

- ``grad_off()``: ``torch.no_grad()`` at about half its cost. ``torch.no_grad`` is a general-purpose
  decorator/context manager whose construction, enter and exit run several Python frames; the
  group's unshard, copy-out and reduce paths enter it a few times per group and step. This does
  only what its enter and exit do: save the grad mode, turn it off, restore it.
- ``labelled(kind, group)``: the profiler label ``fsdp_compose::all_gather blocks.3`` around each
  collective step. When no profiler runs it costs one flag read and returns a shared null context.
"""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.profiler as _autograd_profiler

_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch._C.is_grad_enabled


class grad_off:  # noqa: N801 - used like torch.no_grad
    """``with grad_off():`` runs the block with autograd recording off, then restores the mode."""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = _is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self.previous)


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
