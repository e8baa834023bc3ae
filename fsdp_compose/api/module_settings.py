"""The rest of torch FSDP2's ``FSDPModule`` methods: recovery, reduction and communication settings.

Mixed into ``FSDPModule``. Each method only records a setting on the group's ``GroupSettings``
(``_runtime/settings.py``); the runtime reads them where collectives are issued. Where torch's
setting is about CUDA streams or NCCL and has no meaning on a CPU/gloo group, the method says so
with an error rather than accepting the call and doing something else.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from typing_extensions import deprecated

from .comm import AllGather, ProcessGroupAllGather, ProcessGroupReduceScatter, ReduceScatter, check_comm
from .._runtime.collectives import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
from .._runtime.schedule import end_step, reset_backward
from .._runtime.state import GroupState, class_name, state_of, states_in


class FSDPModuleSettings:
    """Methods of ``FSDPModule`` beyond unshard/reshard/sync (see ``api/module.py``), and the state accessors all use."""

    _fsdp_compose_interface = True  # state.INTERFACE_MARK: class names skip this class

    def _fsdp_state(self) -> GroupState:
        state = state_of(self)
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no fully_shard state")
        return state

    def _fsdp_states(self, recurse: bool) -> list[GroupState]:
        """This call's states (one per mesh), or with ``recurse`` every state in the subtree."""
        if not recurse:
            return self._fsdp_state().call_states
        return [s for _, s in states_in(self)]

    def _set_on_states(self, recurse: bool, **values: object) -> None:
        """Record ``values`` (``GroupSettings`` fields) on this call's states, or with ``recurse`` on every state
        in the subtree."""
        for state in self._fsdp_states(recurse):
            for name, value in values.items():
                setattr(state.settings, name, value)

    def _error(self, text: str, cls: type[Exception] = ValueError) -> Exception:
        """A ``cls`` whose message names the module: ``Block.<text>``."""
        return cls(f"{class_name(self)}.{text}")

    # ----- recovery ---------------------------------------------------------------------
    def reset_iter_state(self) -> None:
        """Recover after an exception aborted ``forward()`` or ``backward()`` mid-step.

        Call it on the root module (the one sharded last and run first), then run the next
        step normally. It waits for in-flight all-gathers and reductions, reshards every group
        and clears the step's bookkeeping. The failed step's pending reductions, HSDP partial
        sums and no-sync accumulation are dropped (restart the micro-batch sequence);
        ``optimizer.zero_grad()`` drops gradients that had already been reduced. Raises
        ``RuntimeError`` on a non-root module.
        """
        state = self._fsdp_state()
        root = state.root
        if root is None:  # before the first forward: the group alone
            state.group.discard_step()
            reset_backward(state)
        elif not state.is_root:
            raise RuntimeError(
                f"reset_iter_state() must be called on the root FSDP module; {class_name(state.module)} "
                f"({state.group.label}) is not the root, {root.root_module_state.group.label} is"
            )
        else:
            end_step(root, failed=True)

    # ----- gradient reduction -----------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size.

        ``1.0`` gives the plain sum over ranks. Works on every backend: the collectives
        always sum (fp32/fp64 divide once after; bf16/fp16 divide before, so the sum cannot
        overflow) instead of using NCCL's ``PREMUL_SUM``. Not recursive, as in FSDP2.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise self._error(f"set_gradient_divide_factor({factor!r}): pass a positive finite number")
        self._set_on_states(False, gradient_divide_factor=float(factor))

    @deprecated("Use `set_gradient_divide_factor` instead")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Require collectives to use only ``ReduceOp.SUM`` (scaling as separate steps).

        fsdp_compose already does so for every dtype and backend, so ``True`` is always
        honoured and ``False`` changes nothing: nothing is recorded. An ``all_reduce_hook``
        receives sums before the final division, as FSDP2 does here.
        """
        self._fsdp_states(recurse=False)  # still refused on a module without fully_shard state

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Include zero gradients for parameters that got none on this rank.

        fsdp_compose always does (with a has-gradient flag per parameter, so a parameter no
        rank used keeps ``.grad`` unchanged), which is what makes rank-dependent control flow
        (mixture of experts) safe; both values behave that way, so nothing is recorded.
        """
        self._fsdp_states(recurse)  # still refused on a module without fully_shard state

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many groups' reductions may be in flight before backward waits for the oldest.

        Each in-flight reduction holds its input buffer; more overlap costs more memory.
        ``1`` waits for the previous reduction before the next starts. The default (unset) is
        the root's limit, 2.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise self._error(
                "set_reduce_scatter_max_input_buffers: "
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}",
                TypeError,
            )
        if max_input_buffers < 1:
            raise self._error(
                "set_reduce_scatter_max_input_buffers: "
                f"max_input_buffers must be a positive int, got {max_input_buffers}"
            )
        self._set_on_states(recurse, reduce_buffers=max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run gradient reduce-scatters on a process group of their own.

        On gloo a process group serves one collective at a time, so a reduce-scatter and
        the next all-gather in backward queue behind each other; with a second group over
        the same ranks they move concurrently. Collective: call it on every rank of the group
        (one new group per distinct set of shard ranks). ``False`` goes back to the shared group.
        """
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for state in self._fsdp_states(recurse):
            settings = state.settings
            if not enable:
                settings.reduce_process_group = None
            elif settings.reduce_process_group is None:
                ranks = tuple(dist.get_process_group_ranks(state.group.process_group))
                if ranks not in created:
                    created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                settings.reduce_process_group = created[ranks]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this group's unsharded parameters.

        ``False`` for groups whose backward uses no parameter values (an embedding: its
        weight gradient needs only the indices) skips the all-gather in backward, saving a
        collective and the memory.
        """
        self._set_on_states(False, unshard_in_backward=bool(unshard_in_backward))

    # ----- communication hooks ----------------------------------------------------------
    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this group's all-gathers through ``comm`` (FSDP2's ``AllGather`` protocol).

        ``comm.allocate(size, dtype=, device=)`` provides the output buffer (one flat
        ``uint8`` buffer for the whole group) and ``comm(output_tensor, input_tensor, group,
        async_op)`` runs the collective, e.g. on another process group.
        """
        self._set_custom_comm("set_custom_all_gather", "all_gather", comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this group's gradient reduce-scatters through ``comm`` (``ReduceScatter`` protocol).

        ``op`` is always ``ReduceOp.SUM``; the input buffer is a ``(world, n)`` table of
        padded gradients in the reduce dtype, flattened.
        """
        self._set_custom_comm("set_custom_reduce_scatter", "reduce_scatter", comm)

    def _set_custom_comm(self, method: str, field: str, comm: AllGather | ReduceScatter) -> None:
        """``comm`` as this call's groups' ``field`` (``all_gather`` or ``reduce_scatter``)."""
        check_comm(comm, method, class_name(self))
        for state in self._fsdp_states(recurse=False):
            if state.settings.pg_allocation:
                raise self._error(
                    f"{method}: cannot be combined with "
                    "set_allocate_memory_from_process_group_for_comm(True); turn that off first"
                )
            setattr(state.settings, field, comm)
            state.settings.custom = True

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None) -> None:
        """Call ``hook(reduce_output)`` on each reduced gradient shard, in place, before the division.

        ``reduce_output`` is the reduce-scatter output (1-D FSDP) or the all-reduce output
        (HSDP): e.g. all-reduce across replicas your own way. ``stream`` runs the hook on a
        CUDA stream; it is refused for HSDP (as in FSDP2) and on CPU (there are no streams).
        """
        if not callable(hook):
            raise self._error(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}", TypeError)
        groups = [state.group for state in self._fsdp_states(recurse=False)]
        if stream is not None:
            if any(group.replicate_group is not None for group in groups):
                raise self._error("set_all_reduce_hook: stream cannot be set when using native HSDP")
            if groups[0].device.type == "cpu":
                raise self._error(
                    "set_all_reduce_hook: stream= needs an accelerator; this group "
                    "computes on CPU, where the hook runs in program order: leave stream unset"
                )
            hook = _on_stream(hook, stream)
        for group in groups:
            group.settings.all_reduce_hook = hook

    # ----- accelerator-only settings ----------------------------------------------------
    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the root's next all-gathers wait for ``event`` (recorded after the optimizer step).

        On an accelerator this replaces waiting for the whole compute stream. On CPU there
        are no streams (collectives are issued in program order, after the optimizer step
        already), so the call is refused rather than ignored.
        """
        state = self._fsdp_state()
        if state.group.device.type == "cpu":
            raise self._error(
                "set_post_optim_event: this group computes on CPU, where there are no streams to order: "
                "the next forward's all-gathers already start after the optimizer step. Drop the call on CPU"
            )
        if not callable(getattr(event, "wait", None)):
            raise self._error(f"set_post_optim_event: expected a torch.Event, got {type(event).__name__}", TypeError)
        for s in self._fsdp_states(recurse=False):
            s.settings.post_optim_event = event

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Allocate all-gather buffers in NCCL symmetric memory (NCCL on CUDA only).

        Refused on other backends (gloo has no symmetric memory) and, for now, on NCCL too:
        fsdp_compose does not implement symmetric-memory buffers yet.
        """
        group = self._fsdp_state().group
        if backend != "NCCL":
            raise self._error(f"set_symm_mem_for_comm(backend={backend!r}): only 'NCCL' is supported")
        used = dist.get_backend(group.process_group)
        if used != "nccl":
            raise self._error(
                "set_symm_mem_for_comm: symmetric memory needs the NCCL "
                f"backend on CUDA; this group's process group uses {used}"
            )
        raise self._error("set_symm_mem_for_comm: not implemented in fsdp_compose yet", NotImplementedError)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate collective buffers with the process group's own allocator, if it has one.

        NCCL can hand out registered memory (zero-copy transfers); gloo has no allocator,
        so buffers keep coming from the default one and a ``UserWarning`` says so. Cannot be
        combined with custom all-gather/reduce-scatter objects.
        """
        for state in self._fsdp_states(recurse=False):
            self._allocate_from_process_group(state.group, enable)

    def _allocate_from_process_group(self, group, enable: bool) -> None:
        settings = group.settings
        if enable and settings.custom:
            raise self._error(
                "set_allocate_memory_from_process_group_for_comm: cannot be "
                "combined with set_custom_all_gather / set_custom_reduce_scatter"
            )
        if settings.pg_allocation == bool(enable):
            return
        if enable:
            all_gather = ProcessGroupAllGather(group.process_group, group.device)
            reduce_scatter = ProcessGroupReduceScatter(settings.reduce_process_group or group.process_group, group.device)
            if not all_gather.supported:
                warnings.warn(
                    f"{class_name(self)}.set_allocate_memory_from_process_group_for_comm: the "
                    f"{dist.get_backend(group.process_group)} process group provides no allocator on "
                    f"{group.device.type}; collective buffers come from the default allocator",
                    stacklevel=2,
                )
        else:
            all_gather, reduce_scatter = DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
        settings.all_gather, settings.reduce_scatter, settings.pg_allocation = all_gather, reduce_scatter, bool(enable)


def _on_stream(hook: Callable[[torch.Tensor], None], stream: torch.Stream) -> Callable[[torch.Tensor], None]:
    def run(tensor: torch.Tensor) -> None:
        current = torch.accelerator.current_stream()
        stream.wait_stream(current)
        with torch.accelerator.stream(stream) if hasattr(torch.accelerator, "stream") else torch.cuda.stream(stream):
            hook(tensor)
        current.wait_stream(stream)

    return run


def share_comm_ctx(modules: list) -> None:
    """Make sharded modules (e.g. pipeline stages, each its own root) share communication resources.

    In FSDP2 that is CUDA streams. fsdp_compose issues collectives from the calling thread
    without side streams; what it shares is the separate reduce-scatter process group: after
    ``set_separate_reduce_scatter_group`` on the first module, the others with the same shard
    ranks reuse its group instead of keeping their own.
    """
    if not modules:
        return
    for module in modules:
        if state_of(module) is None:  # a module is an FSDPModule iff it has state
            raise ValueError(f"share_comm_ctx expects a list of FSDPModules but got {type(module).__name__}")
    shared = next(
        (s.settings.reduce_process_group for _, s in states_in(modules[0]) if s.settings.reduce_process_group),
        None,
    )
    ranks = dist.get_process_group_ranks(state_of(modules[0]).group.process_group)
    for state in [s for module in modules[1:] for _, s in states_in(module)]:
        theirs = dist.get_process_group_ranks(state.group.process_group)
        if theirs != ranks:
            raise ValueError(
                f"share_comm_ctx: {class_name(state.module)} shards over ranks {theirs}, the first module over "
                f"{ranks}; only modules on the same shard ranks can share communication"
            )
        state.settings.reduce_process_group = shared
