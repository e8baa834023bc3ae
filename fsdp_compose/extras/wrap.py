"""Auto-wrap: pick which submodules get their own ``fully_shard`` call, then make the calls.

A policy only *selects* modules (and optional per-module keyword overrides); it never shards.
``apply_fully_shard`` does the sharding, children before parents and the root last, because a
``fully_shard`` call claims every parameter in its subtree that no earlier call claimed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .. import fully_shard
from ..extras_api import group_facts, group_of

Overrides = dict[str, Any]
Selection = dict[nn.Module, Overrides]


class WrapPolicy:
    """Base class: ``select`` returns the modules that become groups, with their overrides."""

    def select(self, root: nn.Module, ignored_params: set[nn.Parameter]) -> Selection:
        raise NotImplementedError


class ModuleWrapPolicy(WrapPolicy):
    """Shard every module that is an instance of one of ``module_classes`` (e.g. transformer blocks)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self.module_classes = tuple(module_classes)

    def select(self, root: nn.Module, ignored_params: set[nn.Parameter]) -> Selection:
        return {m: {} for _, m in root.named_modules() if isinstance(m, self.module_classes)}

    def __repr__(self) -> str:
        names = ", ".join(sorted(cls.__name__ for cls in self.module_classes))
        return f"ModuleWrapPolicy({{{names}}})"


class CustomPolicy(WrapPolicy):
    """Ask ``fn(module)`` for every module: True, False, or a dict of ``fully_shard`` overrides.

    Overrides are checked here so a typo names the module instead of failing deep in a call.
    """

    def __init__(self, fn: Callable[[nn.Module], bool | Overrides]) -> None:
        self.fn = fn

    def select(self, root: nn.Module, ignored_params: set[nn.Parameter]) -> Selection:
        params = inspect.signature(fully_shard).parameters
        options = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        selected: Selection = {}
        for fqn, module in root.named_modules():
            answer = self.fn(module)
            name = fqn or "<root>"
            if isinstance(answer, bool):
                if answer:
                    selected[module] = {}
            elif isinstance(answer, dict):
                unknown = sorted(set(answer) - options)
                if unknown:
                    raise TypeError(
                        f"CustomPolicy: overrides for module '{name}' ({type(module).__name__}) name "
                        f"unknown fully_shard options {unknown}; known: {sorted(options)}"
                    )
                selected[module] = dict(answer)
            else:
                raise TypeError(
                    f"CustomPolicy: fn must return True, False or a dict of fully_shard overrides, "
                    f"but for module '{name}' ({type(module).__name__}) it returned {answer!r}"
                )
        return selected

    def __repr__(self) -> str:
        return f"CustomPolicy({getattr(self.fn, '__name__', self.fn)!r})"


class SizeBasedPolicy(WrapPolicy):
    """Shard a module once the parameters it would claim reach ``min_num_params`` elements.

    Works bottom-up: a module's count excludes parameters already claimed by a selected
    descendant, so a big parent does not get selected only because of its big children.
    A subtree smaller than the threshold is not searched. ``exclude_module_classes`` are never
    selected themselves (containers have no forward to hook) but their children may be;
    ``force_leaf_module_classes`` are never searched below.
    """

    def __init__(
        self,
        min_num_params: int = 100_000_000,
        exclude_module_classes: Iterable[type[nn.Module]] = (nn.ModuleList, nn.ModuleDict),
        force_leaf_module_classes: Iterable[type[nn.Module]] = (nn.MultiheadAttention,),
    ) -> None:
        self.min_num_params = min_num_params
        self.exclude_module_classes = tuple(exclude_module_classes)
        self.force_leaf_module_classes = tuple(force_leaf_module_classes)

    def select(self, root: nn.Module, ignored_params: set[nn.Parameter]) -> Selection:
        selected: Selection = {}
        visited: set[nn.Module] = set()

        def claimed_by_selection(module: nn.Module) -> int:
            """Visit ``module``'s subtree; return the elements selected modules there claim."""
            visited.add(module)
            total = sum(p.numel() for p in module.parameters() if p not in ignored_params)
            if total < self.min_num_params:
                return 0
            if isinstance(module, self.force_leaf_module_classes):
                claimed = 0  # not searched below, but may itself be a group
            else:
                claimed = sum(claimed_by_selection(c) for c in module.children() if c not in visited)
            if total - claimed >= self.min_num_params and not isinstance(module, self.exclude_module_classes):
                selected[module] = {}
                return total
            return claimed

        claimed_by_selection(root)
        return selected

    def __repr__(self) -> str:
        return f"SizeBasedPolicy(min_num_params={self.min_num_params})"


@dataclass
class PlannedGroup:
    """One ``fully_shard`` call that ``apply_fully_shard`` made."""

    fqn: str
    cls: str
    num_params: int
    num_elements: int
    overrides: Overrides


@dataclass
class ShardPlan:
    """What ``apply_fully_shard`` did, in call order (children first, root last)."""

    policy: str
    groups: list[PlannedGroup] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [
            (
                g.fqn or "<root>",
                g.cls,
                f"{g.num_params} params",
                f"{g.num_elements} elements",
                ", ".join(f"{k}={v!r}" for k, v in sorted(g.overrides.items())),
            )
            for g in self.groups
        ]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
        lines = [f"ShardPlan({self.policy}): {len(self.groups)} groups"]
        for row in rows:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]), row[3].rjust(widths[3])]
            lines.append(("  " + "  ".join(cells) + ("  " + row[4] if row[4] else "")).rstrip())
        return "\n".join(lines)


def _post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) with every module after all of its descendants; shared modules once."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[nn.Module] = {root}
    stack: list[tuple[str, nn.Module, bool]] = [("", root, False)]
    while stack:
        fqn, module, expanded = stack.pop()
        if expanded:
            order.append((fqn, module))
            continue
        stack.append((fqn, module, True))
        for name, child in reversed(list(module.named_children())):
            if child not in seen:
                seen.add(child)
                stack.append((f"{fqn}.{name}" if fqn else name, child, False))
    return order


def apply_fully_shard(model: nn.Module, policy: WrapPolicy | None = None, **fully_shard_kwargs: Any) -> ShardPlan:
    """Call ``fully_shard`` on every module ``policy`` selects, bottom-up, then on ``model``.

    ``fully_shard_kwargs`` go to every call; a policy's per-module overrides replace them for
    that module. ``model`` is always sharded (last), so every parameter ends up in a group.
    Selected submodules already sharded by an earlier ``fully_shard`` are left as they are;
    ``model`` itself must not be sharded yet.
    """
    ignored = set(fully_shard_kwargs.get("ignored_params") or ())
    selection = policy.select(model, ignored) if policy is not None else {}
    plan = ShardPlan(policy=repr(policy))
    for fqn, module in _post_order(model):
        if module is not model and (module not in selection or group_of(module) is not None):
            continue
        overrides = selection.get(module, {})
        cls_name = type(module).__name__
        fully_shard(module, **{**fully_shard_kwargs, **overrides})
        params = [p.parameter for p in group_facts(group_of(module)).params]
        plan.groups.append(
            PlannedGroup(fqn, cls_name, len(params), sum(p.numel() for p in params), overrides)
        )
    return plan


__all__ = ["WrapPolicy", "ModuleWrapPolicy", "CustomPolicy", "SizeBasedPolicy", "ShardPlan", "apply_fully_shard"]
