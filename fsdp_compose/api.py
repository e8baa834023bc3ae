"""``fully_shard``: validate, pick the managed parameters, build the group, attach state and hooks."""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .group import ParamGroup
from .hooks.backward import on_grad_accumulated
from .hooks.forward import post_forward, pre_forward
from .mesh import default_mesh, mesh_device
from .module import FSDPModule, become_fsdp_module
from .params import ParamPlace, ShardedParam
from .policies import MixedPrecisionPolicy, OffloadPolicy
from .state import GroupState, owner_of, register_owner, register_state, state_of
from .state_dict_hooks import register_state_dict_hooks


def _managed_params(
    module: nn.Module, ignored: set[nn.Parameter]
) -> tuple[dict[nn.Parameter, list[ParamPlace]], dict[nn.Parameter, str]]:
    """Parameters in ``module``'s subtree not owned by a nested call and not ignored.

    Returns every place each parameter is registered (a tied weight has several) and its
    first name relative to ``module``.
    """
    places: dict[nn.Parameter, list[ParamPlace]] = {}
    names: dict[nn.Parameter, str] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, current = stack.pop()
        for name, param in current._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{prefix}{name}"
            owner = owner_of(param)
            if owner is not None:
                _raise_owned(module, fqn, owner, param)
            places.setdefault(param, []).append(ParamPlace(current, name))
            names.setdefault(param, fqn)
        children = list(current.named_children())
        for child_name, child in reversed(children):
            if state_of(child) is None:
                stack.append((f"{prefix}{child_name}.", child))
    return places, names


def _raise_owned(module: nn.Module, fqn: str, owner: GroupState, param: nn.Parameter) -> None:
    here = type(module).__name__
    there = type(owner.module).__name__
    if param in {p.sharded_param for p in owner.group.params}:
        raise ValueError(
            f"fully_shard({here}): parameter '{fqn}' is already sharded by fully_shard on an "
            f"ancestor module ({there}); call fully_shard on submodules before their parents"
        )
    raise ValueError(
        f"fully_shard({here}): parameter '{fqn}' is shared with a module already sharded by "
        f"fully_shard({there}); a parameter may belong to one group only: call fully_shard on a "
        "module that contains every user of the shared parameter, or ignore it (ignored_params)"
    )


def _check_one_device(module: nn.Module, names: dict[nn.Parameter, str]) -> torch.device | None:
    first_by_device: dict[torch.device, str] = {}
    for param, fqn in names.items():
        first_by_device.setdefault(param.device, fqn)
    if len(first_by_device) > 1:
        listing = ", ".join(f"'{fqn}' on {device}" for device, fqn in first_by_device.items())
        raise ValueError(
            f"fully_shard({type(module).__name__}): parameters are on different devices "
            f"({listing}); move the module to one device first"
        )
    return next(iter(first_by_device), None)


def _check_unsupported(module: nn.Module, mesh: DeviceMesh, options: dict[str, object]) -> None:
    name = type(module).__name__
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard({name}, mesh=<{mesh.ndim}-D mesh>): only a 1-D mesh is supported so far; "
            "HSDP on a 2-D (replicate, shard) mesh is not implemented yet"
        )
    for option, (value, default) in options.items():
        if value != default:
            raise NotImplementedError(f"fully_shard({name}, {option}=...): not implemented yet")


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters on dim 0 across ``mesh`` and gather them only when used.

    Call it on blocks first, then on the root. The module keeps its class (an ``FSDPModule``
    is mixed in), its place in the model and its parameter names; its parameters become
    ``nn.Parameter`` DTensors with ``Shard(0)``, so torch optimizers, ``state_dict()`` and
    ``clip_grad_norm_`` work on them unchanged.

    Args:
        module: the module whose parameters (those not already managed by a nested call)
            form one group: one all-gather before its forward, one reduce-scatter in backward.
        mesh: a 1-D data-parallel mesh; default: all ranks of the default process group.
        reshard_after_forward: free the unsharded parameters after forward and all-gather
            again in backward (saves memory). ``None``: True, except for the root.
        shard_placement_fn, mp_policy, offload_policy: accepted for compatibility with
            ``torch.distributed.fsdp.fully_shard``; non-default values are not supported yet.
        ignored_params: parameters left unsharded, without hooks.

    Returns:
        ``module`` itself, now also an ``FSDPModule``.
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("fully_shard([modules]): grouping several modules is not implemented yet")
    if state_of(module) is not None:
        raise ValueError(
            f"fully_shard was already called on this {type(module).__name__} module; call it once per module"
        )
    mesh = mesh if mesh is not None else default_mesh()
    _check_unsupported(
        module,
        mesh,
        {
            "shard_placement_fn": (shard_placement_fn, None),
            "mp_policy": (mp_policy, MixedPrecisionPolicy()),
            "offload_policy": (offload_policy, OffloadPolicy()),
        },
    )
    if not isinstance(reshard_after_forward, (bool, type(None))):
        raise NotImplementedError(
            f"fully_shard({type(module).__name__}, reshard_after_forward={reshard_after_forward!r}): "
            "resharding to a smaller group of ranks is not implemented yet; pass True or False"
        )
    ignored = set(ignored_params or ())
    places, names = _managed_params(module, ignored)
    param_device = _check_one_device(module, names)
    device = param_device if param_device is not None and param_device.type == "meta" else mesh_device(mesh)
    sharded = [ShardedParam(param, places[param], names[param], mesh, device) for param in places]

    # Nothing above changed the model; from here on, commit.
    group = ParamGroup(sharded, mesh, device)
    state = GroupState(
        module=module,
        group=group,
        reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
    )
    for index, (original, sp) in enumerate(zip(places, sharded)):
        sp.on_grad_accumulated = lambda _param, state=state, index=index: on_grad_accumulated(state, index)
        sp.use(unsharded=False)
        register_owner(original, state)
        register_owner(sp.sharded_param, state)
    register_state(state)
    register_state_dict_hooks(state)
    for buffer_owner in module.modules():
        for name, buffer in buffer_owner._buffers.items():
            if buffer is not None and buffer.device != device and device.type != "meta":
                buffer_owner._buffers[name] = buffer.to(device)
    module.register_forward_pre_hook(partial(pre_forward, state), prepend=True, with_kwargs=True)
    module.register_forward_hook(partial(post_forward, state))
    become_fsdp_module(module)
    return module


__all__ = ["fully_shard", "FSDPModule"]
