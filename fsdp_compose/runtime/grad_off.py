"""``grad_off()``: ``torch.no_grad()`` for the per-collective hot path, at about half its cost.

``torch.no_grad`` is a general-purpose decorator/context manager whose construction, enter and
exit run several Python frames; the group's unshard, copy-out and reduce paths enter it a few
times per group and step. This does only what its enter and exit do: save the grad mode, turn
it off, restore it.
"""

from __future__ import annotations

import torch

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
