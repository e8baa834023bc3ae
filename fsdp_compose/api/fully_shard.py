"""``fully_shard``: validate, pick the managed parameters, build the group, attach state and hooks."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .mesh import default_device_type, default_mesh, mesh_device, post_forward_group
from .module import AlreadyShardedError, FSDPModule, become_fsdp_module
from .._checks.optimizer import install_optimizer_check, mark_ignored
from .._torch_workarounds.pipelining import install_when_used as install_pipelining
from .policies import MixedPrecisionPolicy, OffloadPolicy, validate_policies
from .._torch_workarounds.gloo_exit import drain_at_exit
from .._runtime.group import ParamGroup, PostForward
from .._runtime.hooks.backward import on_grad_accumulated
from .._runtime.hooks.forward import post_forward_hook, pre_forward_hook
from .._runtime.param_layout import ParamPlace, resolve_layout
from .._runtime.params import ShardedParam
from .placement import ShardPlacementResult, resolve_placement
from .._runtime.settings import GroupSettings
from .._runtime.state import GroupState, class_name, owner_of, register_owner, register_state, state_of
from .spmd_mesh import DataParallelMeshDims, data_parallel_dims, data_parallel_mesh, spmd_shard_layout
from .._checks.weights import defer_verdict, unequal_values
from ..whole_model.state_dict_hooks import register_state_dict_hooks

logger = logging.getLogger(__name__)


def _managed_params(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[dict[nn.Parameter, list[ParamPlace]], dict[nn.Parameter, str]]:
    """Parameters in the modules' subtrees not owned by a nested call and not ignored.

    Returns every place each parameter is registered (a tied weight has several) and its
    first name relative to its module (prefixed by the module's index when there are several).
    """
    places: dict[nn.Parameter, list[ParamPlace]] = {}
    names: dict[nn.Parameter, str] = {}
    prefixes = [""] if len(modules) == 1 else [f"[{i}]." for i in range(len(modules))]
    stack: list[tuple[str, nn.Module]] = list(zip(prefixes, modules))[::-1]
    while stack:
        prefix, current = stack.pop()
        for name, param in current._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{prefix}{name}"
            owner = owner_of(param)
            if owner is not None:
                _raise_owned(modules[0], fqn, owner, param, current, prefix)
            places.setdefault(param, []).append(ParamPlace(current, name))
            names.setdefault(param, fqn)
        for child_name, child in reversed(list(current.named_children())):
            if state_of(child) is None and child not in modules:
                stack.append((f"{prefix}{child_name}.", child))
    return places, names


def _move_own_buffers(modules: list[nn.Module], state: GroupState, device: torch.device) -> None:
    """Move the buffers of the call's subtrees to ``device``, as torch's FSDP2 does.

    Modules under a nested ``fully_shard`` are skipped (that call moved their buffers), and so
    are meta buffers: ``to_empty`` materializes them (torchtitan's RoPE caches).
    """
    seen: set[nn.Module] = set()
    stack = list(modules)
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name, buffer in current._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                current._buffers[name] = buffer.to(device)
        stack.extend(child for child in current.children() if state_of(child) in (None, state))


def _raise_owned(
    module: nn.Module, fqn: str, owner: GroupState, param: nn.Parameter, user: nn.Module, user_path: str
) -> None:
    here = class_name(module)
    there = class_name(owner.module)
    if param in {p.sharded_param for p in owner.group.params}:
        raise ValueError(
            f"fully_shard({here}): parameter '{fqn}' is already sharded by fully_shard on an "
            f"ancestor module ({there}); call fully_shard on submodules before their parents"
        )
    user_name = f"{class_name(user)} '{user_path.rstrip('.') or '<self>'}'"
    raise ValueError(
        f"fully_shard({here}): parameter '{fqn}' of {user_name} is already in the group of "
        f"fully_shard({there}); a parameter may belong to one group only: shard its users together "
        f"first, fully_shard([the {there}, the {user_name}]), or shard one module that contains all "
        "of them, or ignore it (ignored_params)"
    )


def _check_one_device(name: str, names: dict[nn.Parameter, str]) -> bool:
    """Raise unless the parameters share one device; whether it is meta (materialized later, by ``to_empty``)."""
    first_by_device: dict[torch.device, str] = {}
    for param, fqn in names.items():
        first_by_device.setdefault(param.device, fqn)
    if len(first_by_device) > 1:
        listing = ", ".join(f"'{fqn}' on {device}" for device, fqn in first_by_device.items())
        raise ValueError(
            f"fully_shard({name}): parameters are on different devices ({listing}); move the module to one device first"
        )
    return any(device.type == "meta" for device in first_by_device)


def _post_forward_ranks(name: str, mesh: DeviceMesh, value: object) -> tuple[bool, int | None]:
    """``reshard_after_forward`` as (whether forward reshards, the ranks that keep a slice after it or None).

    ``None`` (the default) reshards. As in torch, an int of 1 keeps everything (False) and the shard
    group's size is True."""
    if value is None or isinstance(value, bool):
        return value is not False, None
    shard_size = mesh.size(mesh.ndim - 1)
    if not isinstance(value, int) or value < 1 or shard_size % value:
        raise ValueError(
            f"fully_shard({name}, reshard_after_forward={value!r}): pass True, False or a number of ranks "
            f"that divides the shard group size {shard_size} (e.g. the ranks of one node)"
        )
    return value > 1, None if value in (1, shard_size) else value


_NOT_DATA_PARALLEL = ("tp", "cp", "pp", "ep", "tensor", "context", "pipeline", "expert")


def _check_mesh(name: str, mesh: DeviceMesh) -> None:
    """A 1-D mesh, or a 2-D one whose dim names say (replicate, shard), the order it is read in by position:
    a mesh built in the other order, or the full (dp, tp) mesh, would otherwise run HSDP on the wrong axes
    without a word. torch's FSDP2 also requires dim names."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard({name}, mesh=<{mesh.ndim}-D mesh>): pass a 1-D mesh (shard) or a 2-D mesh "
            "(replicate, shard) for HSDP; for tensor parallelism pass the data-parallel sub-mesh"
        )
    if mesh.ndim == 1:
        return
    dim_names = mesh.mesh_dim_names
    example = "init_device_mesh(..., (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
    if dim_names is None:
        raise MeshRoleError(
            f"fully_shard({name}, mesh=<2-D mesh without dim names>): a 2-D mesh is HSDP, read as "
            f"(replicate, shard) by position; name its dims so the order is explicit: {example}"
        )
    first, last = (n.lower() for n in dim_names)
    reversed_roles = "replicate" in last or ("shard" in first and "replicate" not in first)
    other_parallelism = any(last == tag or last.startswith(tag + "_") for tag in _NOT_DATA_PARALLEL)
    if reversed_roles or other_parallelism:
        hint = (
            "for tensor (or other) parallelism pass the data-parallel sub-mesh, e.g. mesh['dp']"
            if other_parallelism
            else f"build it in that order: {example}"
        )
        raise MeshRoleError(
            f"fully_shard({name}, mesh=<2-D mesh with dims {dim_names}>): a 2-D mesh is HSDP, read as "
            f"(replicate, shard) by position, but the names say otherwise; {hint}"
        )


class MeshRoleError(ValueError, AssertionError):
    """A mesh whose dims' roles are ambiguous: a ``ValueError``, and the ``AssertionError`` torch's FSDP2 raises."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


def _check_module(module: nn.Module) -> None:
    if state_of(module) is not None:
        raise AlreadyShardedError(
            f"fully_shard was already called on this {class_name(module)} module; call it once per module "
            "(Each distinct composable distributed API can only be applied to a module once.)"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward ({class_name(module)}): "
            "shard its children one by one, or pass them as a list, fully_shard(list(container))"
        )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters across ``mesh`` (dim 0 unless told) and gather them only when used.

    Call it on blocks first, then on the root. The module keeps its class (an ``FSDPModule``
    is mixed in), its place in the model and its parameter names; its parameters become
    ``nn.Parameter`` DTensors with ``Shard(0)``, so torch optimizers, ``state_dict()`` and
    ``clip_grad_norm_`` work on them unchanged.

    Args:
        module: the module whose parameters (those not already managed by a nested call)
            form one group: one all-gather before its forward, one reduce-scatter in backward.
            A list of modules forms one group together (e.g. a tied embedding and output
            projection): whichever runs first gathers it.
        mesh: a 1-D data-parallel mesh, or a 2-D ``(replicate, shard)`` mesh for HSDP
            (shard within the last dim, all-reduce gradients across the first); default: all
            ranks of the default process group.
        reshard_after_forward: free the unsharded parameters after forward and all-gather
            again in backward (saves memory). ``None``: True, except at the root, which keeps
            its parameters after a forward with grad enabled (backward needs them at once);
            passed explicitly, the root follows it too, as in torch's FSDP2. An int N
            (dividing the shard group size) keeps an N-way slice after forward, so backward
            re-gathers within N consecutive ranks (one node) instead of the whole group.
        mp_policy: dtypes for the all-gather (``param_dtype``), the gradient reduction
            (``reduce_dtype``) and forward outputs; shards, gradients and optimizer state keep
            the parameters' own dtypes.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients on CPU (the
            optimizer steps there) and moves them to the compute device for the all-gather.
        shard_placement_fn: called with each managed parameter; returns ``Shard(d)`` to shard
            it on dim ``d`` (e.g. the expert dim of an MoE weight) or ``None`` for ``Shard(0)``.
            Any size works on any dim: ranks hold ``torch.chunk`` pieces (torch's FSDP2
            requires dims after 0 to divide evenly). The module still sees the full,
            contiguous parameter; its shard is a DTensor with that ``Shard(d)``. Or it returns
            ``ShardPlacementResult(placement, mesh_info)`` to put the parameter on a mesh of its own
            (e.g. MoE experts over their expert-data-parallel mesh; torch's own ``ShardPlacementResult``
            is taken too): ``placement`` as above, ``mesh_info`` a ``DeviceMesh`` (1-D, or 2-D for HSDP)
            or torch's ``FSDPMeshInfo``/``HSDPMeshInfo``. The call's parameters on each mesh form a
            group of their own, with its own all-gather and reduce-scatter.
        ignored_params: parameters left unsharded, without hooks.
        dp_mesh_dims: ``mesh`` is a full SPMD mesh (e.g. dims ``("dp_replicate", "dp_shard",
            "tp")``) and every parameter is already a DTensor on it with ``Replicate()`` on the
            data-parallel dims; ``DataParallelMeshDims(shard=..., replicate=...)`` names them
            (a tuple of names is flattened into one dim). Gradients are reduce-scattered over
            the shard dims and all-reduced over the replicate dims.

    Returns:
        ``module`` itself (or the list), now also an ``FSDPModule``.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard([]): pass at least one module")
    for m in modules:
        _check_module(m)
    name = class_name(modules[0])
    mesh = mesh if mesh is not None else default_mesh()
    spmd_mesh, dp_dims = None, frozenset()
    if dp_mesh_dims is not None:
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"fully_shard({name}, reshard_after_forward={reshard_after_forward!r}, "
                "dp_mesh_dims=...): an int is not supported with dp_mesh_dims; pass True or False"
            )
        spmd_mesh, mesh = mesh, data_parallel_mesh(name, mesh, dp_mesh_dims)
        dp_dims = data_parallel_dims(spmd_mesh, dp_mesh_dims)
    _check_mesh(name, mesh)
    validate_policies(name, mesh.device_type, default_device_type(), mp_policy, offload_policy)
    forward_reshards, _ = _post_forward_ranks(name, mesh, reshard_after_forward)
    ignored = set(ignored_params or ())
    for param in ignored:
        mark_ignored(param)
    places, names = _managed_params(modules, ignored)
    on_meta = _check_one_device(name, names)
    # one group per mesh, in the order of their first parameters
    by_mesh: dict[tuple, tuple[DeviceMesh, dict[nn.Parameter, ShardedParam]]] = {}
    for param in places:
        fqn = names[param]
        shard_dim, param_mesh = resolve_placement(shard_placement_fn, param, fqn, name)
        spmd = None
        if spmd_mesh is not None:
            if param_mesh is not None:
                raise NotImplementedError(
                    f"fully_shard({name}, dp_mesh_dims=...): shard_placement_fn put parameter '{fqn}' "
                    "on a mesh of its own; a per-parameter mesh takes a data-parallel mesh, not dp_mesh_dims"
                )
            spmd = spmd_shard_layout(name, spmd_mesh, dp_mesh_dims, mesh, param, fqn, shard_dim)
        group_mesh = mesh if param_mesh is None else param_mesh
        layout = resolve_layout(param.dtype, mesh_device(group_mesh), mp_policy, offload_policy, on_meta)
        sp = ShardedParam(param, places[param], fqn, group_mesh, layout, shard_dim, spmd, dp_dims, mp_policy)
        by_mesh.setdefault(_mesh_key(group_mesh), (group_mesh, {}))[1][param] = sp
    if not by_mesh:  # a call without parameters still has a (empty) group on its mesh
        by_mesh[_mesh_key(mesh)] = (mesh, {})

    groups = []
    for group_mesh, sharded in by_mesh.values():
        if group_mesh is not mesh:
            _check_mesh(name, group_mesh)
        _, post_forward_ranks = _post_forward_ranks(name, group_mesh, reshard_after_forward)
        device = mesh_device(group_mesh)
        unequal = unequal_values(name, {names[p]: p for p in sharded}, group_mesh, device)  # a collective
        groups.append((group_mesh, sharded, device, post_forward_ranks, unequal))

    # Nothing above changed the model; from here on, commit.
    chosen = reshard_after_forward is not None
    options = dict(reshard_after_forward=forward_reshards, reshard_after_forward_chosen=chosen, mp_policy=mp_policy)
    states = [_build_state(modules, *group[:4], options) for group in groups]
    for s, (*_, unequal) in zip(states, groups):
        defer_verdict(s, unequal)  # raised at the first forward unless the shards are written before it
    state = states[0]
    state.companions = states[1:]
    for s in state.companions:  # the one link a state cannot have at construction: they are built together
        s.primary = state
    # the process-wide effects, each once and unless opted out (fsdp_compose.process_wide_effects lists them)
    install_optimizer_check()
    install_pipelining()  # now if the program imported torch.distributed.pipelining, else at its import
    drain_at_exit(state.group.process_group.name())  # on gloo: its worker threads done before finalization
    register_state(state)
    if not on_meta:
        _move_own_buffers(modules, state, state.group.device)
    for m in modules:
        for s in states[::-1]:  # pre-hooks are prepended: the call's first state runs first
            register_state_dict_hooks(s, m)
            m.register_forward_pre_hook(partial(pre_forward_hook, s), prepend=True, with_kwargs=True)
        for s in states:
            m.register_forward_hook(partial(post_forward_hook, s))
        become_fsdp_module(m)
    if logger.isEnabledFor(logging.DEBUG):
        group_sizes = [(s.group.world_size, s.group.dp_size // s.group.world_size) for s in states]
        meshes = ", ".join(f"{ranks} ranks x {replicas} replica(s)" for ranks, replicas in group_sizes)
        logger.debug("fully_shard(%s): %d parameters in %d group(s) over %s", name, len(places), len(states), meshes)
    return module


def _mesh_key(mesh: DeviceMesh) -> tuple:
    """Meshes over the same ranks in the same layout form one group (FSDP2 keys by process group)."""
    return tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())


def _build_state(
    modules: list[nn.Module],
    mesh: DeviceMesh,
    sharded: dict[nn.Parameter, ShardedParam],
    device: torch.device,
    ranks: int | None,  # reshard_after_forward=<int>: the ranks that keep a slice after forward
    options: dict,
) -> GroupState:
    """One group of a call (the parameters on one mesh) and its state; marks its parameters as its own."""
    post_forward = None if ranks is None else PostForward(ranks, post_forward_group(mesh, ranks))
    # the call's options, each group with its own settings; the process group's own collectives until
    # set_custom_* swaps them
    settings = GroupSettings(**options)
    group = ParamGroup(list(sharded.values()), mesh, device, class_name(modules[0]), settings, post_forward)
    state = GroupState(modules=modules, group=group, settings=settings)
    for index, (original, sp) in enumerate(sharded.items()):
        sp.on_grad_accumulated = partial(on_grad_accumulated, weakref.ref(state), index)  # a post-accumulate-grad hook
        sp.use(unsharded=False)
        register_owner(original, state, replaced_at=sp.fqn)  # the optimizer check names it (optimizer_check.py)
        register_owner(sp.sharded_param, state)
    return state


# the state object of the call on a module, as torch's composable APIs offer: one per fully_shard call
fully_shard.state = state_of  # type: ignore[attr-defined]

__all__ = ["fully_shard", "FSDPModule", "DataParallelMeshDims"]
