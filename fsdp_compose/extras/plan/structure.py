"""Where a model repeats itself: the units ``plan`` shards, checkpoints and keeps one by one.

A transformer's layers are a ``ModuleList`` (or ``Sequential``) of children of one class; each is
the natural ``fully_shard`` group and the natural activation-checkpointing region, and being alike
they cost alike, so two measurements price any number of them (``search.py``). A model without
such a run still gets units: the root's children that hold parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Units:
    """The modules ``plan`` treats one by one, by name, in the order the model holds them."""

    names: tuple[str, ...]
    repeated: bool  # alike blocks of one ModuleList / Sequential; else the root's children with parameters
    kind: str  # the blocks' class, for the table

    def describe(self) -> str:
        if not self.names:
            return "no submodule with parameters: the root alone"
        span = self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"
        what = f"repeated blocks of {self.kind}" if self.repeated else "the root's children with parameters"
        return f"{len(self.names)} {what} ({span})"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_units(model: nn.Module) -> Units:
    """The largest run (by parameters) of same-class children of a ModuleList or Sequential, else the
    root's children holding parameters."""
    best: tuple[int, Units] | None = None
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[str]] = {}
        for child_name, child in container.named_children():
            if _numel(child) > 0:
                by_class.setdefault(type(child), []).append(f"{name}.{child_name}" if name else child_name)
        for cls, names in by_class.items():
            if len(names) < 2:
                continue
            size = sum(_numel(model.get_submodule(n)) for n in names)
            if best is None or size > best[0]:
                best = (size, Units(tuple(names), True, cls.__name__))
    if best is not None:
        return best[1]
    names = tuple(name for name, child in model.named_children() if _numel(child) > 0)
    return Units(names, False, "")


def children_with_parameters(module: nn.Module) -> list[nn.Module]:
    return [child for child in module.children() if _numel(child) > 0]


def has_own_parameters(module: nn.Module) -> bool:
    """Parameters registered on the module itself, not under a child (a block's own scale, say)."""
    return any(p is not None for p in module._parameters.values())
