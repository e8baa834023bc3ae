"""FSDPModule: the methods a sharded module gains, mixed in by swapping its class.

The new class subclasses the original, so ``isinstance(m, OriginalCls)`` still holds and the
module keeps its place, name and forward.
"""

from __future__ import annotations

import functools

from torch import nn

from .module_settings import FSDPModuleSettings
from .._runtime.hooks.forward import frame_not_traced
from .._runtime.refresh import follow_module
from .._runtime.state import INTERFACE_MARK, GroupState, class_name, state_of, user_class


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, state: GroupState) -> None:
        self._states = state.call_states

    def wait(self) -> None:
        for state in self._states:
            state.group.wait_unshard()


class AlreadyShardedError(ValueError, AssertionError):
    """``fully_shard`` called twice on one module.

    Both a ``ValueError`` (bad argument) and an ``AssertionError`` (what torch's FSDP2 raises),
    so ``except`` clauses written for either keep working.
    """

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


class DeepcopyUnsupportedError(RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module (an ``AssertionError`` in torch's FSDP2 too)."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


class FSDPModule(FSDPModuleSettings):
    """Interface of every module ``fully_shard`` was called on."""

    _fsdp_compose_interface = True  # state.INTERFACE_MARK: class names skip this class

    def __new__(cls, *args, **kwargs):
        """Build the user's class, not the swapped-in FSDP subclass.

        Containers create new instances of their own class, e.g. ``sequential[:2]``; such a
        slice has no sharding state of its own, so it must not claim to be an ``FSDPModule``.
        """
        user_cls = user_class(cls)
        instance = user_cls.__new__(user_cls, *args, **kwargs)
        instance.__init__(*args, **kwargs)
        return instance

    @frame_not_traced
    def _call_impl(self, *args, **kwargs):
        """``nn.Module``'s call, in a frame dynamo does not trace: a compiled block starts compiling at
        its ``forward`` (``_runtime/hooks/forward.py``)."""
        return super()._call_impl(*args, **kwargs)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (e.g. ahead of its forward).

        With ``async_op=True`` the all-gather is only issued; ``handle.wait()`` completes it.
        """
        state = self._fsdp_state()
        for s in state.call_states:
            if s.root is None:  # before the first forward: follow parameters replaced or materialized since fully_shard
                follow_module(s)
            s.group.start_unshard()
        if async_op:
            return UnshardHandle(state)
        for s in state.call_states:
            s.group.wait_unshard()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones again."""
        for state in self._fsdp_states(recurse=False):
            state.group.reshard()

    def _apply(self, fn, *args, **kwargs):
        """``model.to(dtype)``, ``.double()``, ``to_empty(...)``: convert the sharded parameters
        (resharded first), then let the group follow their new dtype; see ``_runtime/refresh.py``."""
        state = state_of(self)
        states = state.call_states if state is not None else []
        for s in states:
            s.group.reshard()
        out = super()._apply(fn, *args, **kwargs)
        for s in states:
            follow_module(s)
        return out

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction off for accumulation steps (like DDP's ``no_sync``).

        While off, unsharded gradients accumulate locally; the first backward with sync on
        reduces them together with its own.
        """
        self._set_on_states(recurse, requires_gradient_sync=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: skip the all-reduce across replicas for accumulation steps.

        Reduce-scatters still run; their results are kept as partial sums and all-reduced
        together at the first backward with all-reduce back on.
        """
        self._set_on_states(recurse, requires_all_reduce=requires_all_reduce)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep parameters unsharded after backward (saves an all-gather next forward)."""
        self._set_on_states(recurse, reshard_after_backward=reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether parameters are freed after forward and re-gathered in backward."""
        if not isinstance(reshard_after_forward, bool):
            raise self._error(f"set_reshard_after_forward: pass True or False, got {reshard_after_forward!r}")
        # chosen: the root follows it too
        self._set_on_states(recurse, reshard_after_forward=reshard_after_forward, reshard_after_forward_chosen=True)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules right after this one's all-gather in forward.

        Replaces the recorded-order prefetch for this module; an empty list turns it off.
        """
        self._set_on_states(False, forward_prefetch=_prefetch_targets(modules))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules right after this one's all-gather in backward."""
        self._set_on_states(False, backward_prefetch=_prefetch_targets(modules))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """When False, the end of backward does not wait for gradient reductions.

        For pipeline schedules running several backward passes per step; the reductions are
        waited for at the next last backward or the next root forward.
        """
        self._set_on_states(False, is_last_backward=is_last_backward)


def _prefetch_targets(modules: list[nn.Module]) -> list[GroupState]:
    """The states of the calls on ``modules``, in order (each call's states, one per mesh)."""
    for module in modules:
        if state_of(module) is None:
            raise ValueError(f"cannot prefetch {class_name(module)}: fully_shard was not called on it")
    return [s for m in modules for s in state_of(m).call_states]


def become_fsdp_module(module: nn.Module) -> None:
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        module.__class__ = _fsdp_class(cls)


@functools.cache
def _fsdp_class(cls: type) -> type:
    """The swapped-in subclass of ``cls``, one per class."""
    return type(
        f"FSDP{cls.__name__}",
        (FSDPModule, cls),
        {"__module__": cls.__module__, "__deepcopy__": _refuse_deepcopy, INTERFACE_MARK: True},
    )


def _refuse_deepcopy(module: nn.Module, memo: dict) -> None:
    raise DeepcopyUnsupportedError(
        f"copy.deepcopy({class_name(module)}): FSDP does not support deepcopy of a sharded module "
        "(its parameters are shards tied to process groups and hooks); deepcopy the model before "
        "fully_shard, or copy its weights with state_dict()/full_state_dict() into a fresh model"
    )
