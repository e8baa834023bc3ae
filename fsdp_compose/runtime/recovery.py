"""``reset_iter_state``: recover from an exception that aborted a forward or backward."""

from __future__ import annotations

from .schedule import end_step
from .state import GroupState, class_name


def reset_iteration(state: GroupState) -> None:
    """Wait for in-flight collectives, reshard every group under the root, clear per-step state.

    Gradients of the failed step that were still being reduced, HSDP partial sums and no-sync
    accumulation are discarded: the failed micro-batch sequence is lost, as in torch's FSDP2.
    Reductions that had already finished stay in ``.grad``; ``optimizer.zero_grad()`` drops them.
    """
    root = state.root
    if root is not None and not state.is_root:
        raise RuntimeError(
            f"reset_iter_state() must be called on the root FSDP module; {class_name(state.module)} "
            f"({state.group.label}) is not the root, {root.root_module_state.group.label} is"
        )
    for s in root.states if root is not None else [state]:
        s.group.discard_step()
        s.reset_backward()
    if root is not None:
        root.reducing.clear()
        end_step(root, failed=True)
