"""Issue collectives with no Python objects in the thread-local state they capture.

Every c10d ``Work`` copies the calling thread's ``at::ThreadLocalState``. During
``loss.backward()`` that state holds a Python object (torch stashes a ``contextvars.Context``
in TLS for the autograd engine), and inside activation checkpointing it holds the saved-tensor
hooks. gloo's worker thread often drops the last reference to a finished ``Work``; destroying
a Python object there needs the GIL. If the main thread is in interpreter shutdown at that
moment, CPython ends the worker thread from inside a ``noexcept`` destructor and the process
dies with ``terminate called without an active exception`` (SIGABRT) after a successful run.
Hiding those objects while a collective is issued keeps every ``Work`` free of Python
references, so its destruction never needs the GIL (see docs/troubleshooting.md).
"""

from __future__ import annotations

import contextlib

import torch

_CONTEXT_KEY = "context"  # torch.autograd.graph._engine_run_backward stashes it during backward
_autograd = torch._C._autograd
_NULL = contextlib.nullcontext()
# bound once: these run up to four times per group and step in backward
_is_key_in_tls = torch._C._is_key_in_tls
_get_obj_in_tls = torch._C._get_obj_in_tls
_remove_obj_from_tls = torch._C._remove_obj_from_tls
_stash_obj_in_tls = torch._C._stash_obj_in_tls
_top_hooks = _autograd._top_saved_tensors_default_hooks
_pop_hooks = _autograd._pop_saved_tensors_default_hooks
_push_hooks = _autograd._push_saved_tensors_default_hooks


def python_free_tls() -> contextlib.AbstractContextManager:
    """Temporarily remove the backward's stashed context and any saved-tensor hooks from TLS.

    Outside backward and checkpointing there is nothing to hide: a shared no-op context then
    saves the generator-based one (a few µs per collective)."""
    if _is_key_in_tls(_CONTEXT_KEY) or _top_hooks(True) is not None:
        return _HidePythonObjects()
    return _NULL


class _HidePythonObjects:
    """Takes the objects out of TLS on enter and puts them back, in order, on exit."""

    __slots__ = ("context", "hooks")

    def __enter__(self) -> None:
        self.context = None
        if _is_key_in_tls(_CONTEXT_KEY):
            self.context = _get_obj_in_tls(_CONTEXT_KEY)
            _remove_obj_from_tls(_CONTEXT_KEY)
        self.hooks = None  # the usual backward has none: no list then
        while (top := _top_hooks(True)) is not None:
            if self.hooks is None:
                self.hooks = []
            self.hooks.append(top)
            _pop_hooks()

    def __exit__(self, *exc: object) -> None:
        if self.hooks is not None:
            for pack, unpack in reversed(self.hooks):
                _push_hooks(pack, unpack)
        if self.context is not None:
            _stash_obj_in_tls(_CONTEXT_KEY, self.context)
