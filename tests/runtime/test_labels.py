"""Profiler labels: every collective step of every group shows up in a trace by module name."""

import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose._runtime.collectives import _NULL, labelled
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root

KINDS = ["copy_in", "all_gather", "wait", "copy_out", "reduce_scatter", "all_reduce"]
GROUPS = ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def _profile_one_step():
    import torch.distributed as dist

    # a (1, 2) HSDP mesh: one replica, so the all-reduce runs too at world size 2
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model, mesh=mesh)
    batch = local_slice(global_batch(0, 2), dist.get_rank(), 2)
    lm_loss(model, batch).backward()  # first step: lazy init names the groups
    off = labelled("all_gather", model.blocks[0]._fsdp_state().group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lm_loss(model, batch).backward()
    return off is _NULL, {e.name for e in prof.events() if e.name.startswith("fsdp_compose::")}


def test_profile_of_one_step_has_every_label():
    for off_is_null, names in run_on_ranks(2, _profile_one_step):
        assert off_is_null  # no profiler: no record_function is built
        missing = {f"fsdp_compose::{k} {g}" for k in KINDS for g in GROUPS} - names
        assert not missing, sorted(missing)


def _labels_before_and_after_the_first_forward():
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model)
    group = model.blocks[1]._fsdp_state().group
    before = group.label, group.fqn
    model(torch.randint(0, 37, (2, 5)))
    return before, (group.label, group.fqn)


def test_a_group_is_named_by_its_class_then_by_its_fqn():
    for before, after in run_on_ranks(1, _labels_before_and_after_the_first_forward):
        assert before == ("Block", None)
        assert after == ("'blocks.1' (Block)", "blocks.1")
