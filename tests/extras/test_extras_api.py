"""The extras' port (``fsdp_compose/extras_api.py``): a group handle is a key that shows nothing of its group.

``tests/meta/test_architecture.py`` checks on the sources that no extra reads the handle's private field; here, at
run time, that there is nothing else to read: the runtime's attributes are not on a handle, it cannot be changed,
and the same group always gives the same handle, so handles work as keys and compare with ``is``.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import fsdp_compose.extras_api as port
from fsdp_compose import fully_shard
from fsdp_compose.extras_api import GroupHandle, group_facts, group_of, groups_in, owner_of, recorded_order


def test_a_handle_shows_nothing_of_its_group(single_rank_group) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    (_, root), (_, child) = groups_in(model)
    for handle in (root, child):
        assert isinstance(handle, GroupHandle)
        # GroupState's, ParamGroup's and RootState's attributes, as an extra once could read them
        for name in ("phase", "is_root", "group", "settings", "root", "modules", "primary", "uid", "mesh", "params"):
            with pytest.raises(AttributeError):
                getattr(handle, name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            handle.phase = 1
    assert repr(child) == "GroupHandle(Linear)"  # the group's label

    # one handle per group: the same object from every function that names the group
    assert group_of(model) is root and group_of(model[0]) is child
    assert owner_of(model[0].weight) is child and owner_of(nn.Parameter(torch.zeros(1))) is None
    assert [h for _, h in groups_in(model)] == [root, child] and root != child
    facts = group_facts(child)
    assert facts.handle is child and facts.call == (child,) and facts.root is None and recorded_order(child) == []
    model(torch.randn(2, 4)).sum().backward()
    model(torch.randn(2, 4)).sum().backward()  # the second forward ends the first step, which recorded the order
    assert group_facts(child).root is root and recorded_order(child) == [root, child]


def test_the_port_hands_out_core_names_only_as_exported() -> None:
    """Besides its own facts and functions, the port's names without an underscore are the core's, exported by
    name (no wrapper): none is a runtime class or a function that returns runtime state."""
    from_core = sorted(
        name
        for name, value in vars(port).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("fsdp_compose.")
        and value.__module__ != port.__name__
    )
    assert from_core == [
        "COMPLETED",
        "DIRECT_ALL_GATHER",
        "DIRECT_REDUCE_SCATTER",
        "raise_together",
        "reshard_idle",
        "row_layout",
        "set_gather_codec",
        "user_class",
        "wait_named",
    ]
