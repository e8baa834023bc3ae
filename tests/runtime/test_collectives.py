"""Counts of real c10d calls per step: one all-gather per group per unshard, one reduce-scatter per group."""

import sys
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed import ProcessGroup

from fsdp_compose import FSDPModule
from fsdp_compose._runtime.collectives import (
    DIRECT_ALL_GATHER,
    GATHER_METHOD,
    SCATTER_METHOD,
    GatherLayout,
    copy_out,
)
from tests.harness import run_on_ranks
from tests.models import TinyLM, lm_loss, shard_blocks_then_root

# all_gather_single and reduce_scatter_single are counted where they reach the process group
# (``dist.all_gather_single`` calls ``ProcessGroup.all_gather_single``; fsdp_compose calls the
# latter directly), so a collective is counted whichever way it was issued, and once; under torch
# 2.13's names whatever the installed torch calls these methods (collectives.GATHER_METHOD)
PROCESS_GROUP_WATCHED = {GATHER_METHOD: "all_gather_single", SCATTER_METHOD: "reduce_scatter_single"}
WATCHED = [
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
]


def _from_order_check() -> bool:
    """The order check (_checks/order.py) and the shared-memory transport's syncs
    (fsdp_compose_shm/__init__.py) move no parameter data: not data collectives."""
    return sys._getframe(2).f_code.co_filename.endswith(("_checks/order.py", "fsdp_compose_shm/__init__.py"))


@contextmanager
def count_collectives():
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in WATCHED}
    methods = {name: getattr(ProcessGroup, name) for name in PROCESS_GROUP_WATCHED}
    raw = {name: vars(ProcessGroup)[name] for name in PROCESS_GROUP_WATCHED}  # what restoring needs

    def counting(name):
        def call(*args, **kwargs):
            if not _from_order_check():
                counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    def counting_method(name):
        def call(self, *args, **kwargs):
            if not _from_order_check():
                counts[PROCESS_GROUP_WATCHED[name]] += 1
            return methods[name](self, *args, **kwargs)

        return call

    for name in WATCHED:
        setattr(dist, name, counting(name))
    for name in PROCESS_GROUP_WATCHED:
        setattr(ProcessGroup, name, counting_method(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for name, fn in raw.items():
            setattr(ProcessGroup, name, fn)



@contextmanager
def record_gathers():
    """Every data all-gather as it reaches the process group, in order, as (group size, output dtype,
    output bytes): measured at the collective, not from our counters. The order check's int64 rounds
    are left out."""
    calls, raw = [], vars(ProcessGroup)[GATHER_METHOD]  # the raw method: what restoring needs (pybind)

    def record(group, output, input, *args):
        if output.dtype != torch.int64:
            calls.append((group.size(), output.dtype, output.numel() * output.element_size()))
        return raw(group, output, input, *args)

    setattr(ProcessGroup, GATHER_METHOD, record)
    try:
        yield calls
    finally:
        setattr(ProcessGroup, GATHER_METHOD, raw)

def _counts():
    torch.manual_seed(0)
    model = TinyLM()  # 3 blocks + root = 4 groups
    shard_blocks_then_root(model)
    ids = torch.randint(0, 37, (2, 6))
    phases = {}
    with count_collectives() as counts:
        loss = lm_loss(model, ids)
    phases["forward"] = dict(counts)
    with count_collectives() as counts:
        loss.backward()
    phases["backward"] = dict(counts)
    # no-sync micro-batch: gathers, but no reduction
    model.set_requires_gradient_sync(False)
    with count_collectives() as counts:
        lm_loss(model, ids).backward()
    phases["no_sync_step"] = dict(counts)
    model.set_requires_gradient_sync(True)
    with count_collectives() as counts:
        lm_loss(model, ids).backward()
    phases["sync_step"] = dict(counts)
    with count_collectives() as counts, torch.no_grad():
        model(ids[:, :-1])
    phases["no_grad_forward"] = dict(counts)
    return phases


def test_one_collective_per_group():
    results = run_on_ranks(2, _counts)
    assert results[0] == results[1]
    text = "\n".join(f"{phase}: {sorted(c.items())}" for phase, c in results[0].items())
    # forward: 4 groups gathered; backward: the 3 resharded blocks gathered again, 4 reductions
    assert_expected_inline(
        text,
        """\
forward: [('all_gather_single', 4)]
backward: [('all_gather_single', 3), ('reduce_scatter_single', 4)]
no_sync_step: [('all_gather_single', 7)]
sync_step: [('all_gather_single', 7), ('reduce_scatter_single', 4)]
no_grad_forward: [('all_gather_single', 4)]""",
    )


def _module_interface():
    from fsdp_compose._runtime.state import state_of
    from tests.models import Block

    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model)
    out = {
        "isinstance": [isinstance(model, TinyLM), isinstance(model, FSDPModule), isinstance(model.blocks[0], FSDPModule)],
        "block_class": isinstance(model.blocks[0], Block),
        "names": [n for n, _ in model.blocks[0].named_parameters()],
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
    }
    block = model.blocks[1]
    handle = block.unshard(async_op=True)
    handle.wait()
    out["unsharded_type"] = type(block.fc1.weight).__name__
    out["unsharded_shape"] = list(block.fc1.weight.shape)
    block.reshard()
    out["resharded_type"] = type(block.fc1.weight).__name__
    out["bytes_after_reshard"] = state_of(block).group.unsharded_nbytes()
    # keep params unsharded after backward: no gather in the next forward for those groups
    model.set_reshard_after_backward(False)
    ids = torch.randint(0, 37, (2, 6))
    lm_loss(model, ids).backward()
    out["kept_after_backward"] = [state_of(m).group.unsharded_nbytes() > 0 for m in [model, *model.blocks]]
    with count_collectives() as counts:
        model(ids)
    out["gathers_next_forward"] = counts["all_gather_single"]
    return out


def test_fsdp_module_interface():
    (r,) = run_on_ranks(1, _module_interface)
    assert r["isinstance"] == [True, True, True] and r["block_class"]
    assert r["names"] == ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert r["param_types"] == ["DTensor"]
    assert r["unsharded_type"] == "Parameter" and r["unsharded_shape"] == [29, 13]
    assert r["resharded_type"] == "DTensor" and r["bytes_after_reshard"] == 0
    assert r["kept_after_backward"] == [True, True, True, True]
    assert r["gathers_next_forward"] == 0


def test_one_rank_sends_nothing(single_rank_group):
    """World size 1: all-gathers and reduce-scatters are copies, no c10d call, as in torch's FSDP2
    (its TestFullyShardWorldSize1 counts zero collectives); gradients still match an unsharded copy."""
    import copy

    from torch import nn
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    model = copy.deepcopy(reference)
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(4, 7)
    for _ in range(2):
        with CommDebugMode() as comm:
            model(x).sum().backward()
        assert comm.get_total_counts() == 0
    reference(x).sum().backward()
    reference(x).sum().backward()
    for p, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, atol=1e-6, rtol=0)


def test_copy_out_frees_a_cpu_gather_buffer_that_a_finished_work_still_holds():
    """gloo's worker thread keeps a finished work, and the output it refers to, until it next runs: the
    copy-out frees a CPU buffer on gloo itself, so the step's peak does not wait on that thread."""
    layout = GatherLayout([2, 1], world_size=2)
    for free in (True, False):
        gathered = torch.arange(6.0).view(2, 3)
        held_by_work = gathered.view(-1)  # what a finished work still refers to
        targets = [torch.empty(2, 2), torch.empty(2, 1)]
        copy_out(gathered, layout, targets, free)
        assert targets[0].tolist() == [[0.0, 1.0], [3.0, 4.0]] and targets[1].tolist() == [[2.0], [5.0]]
        assert (held_by_work.untyped_storage().nbytes() == 0) == free


def _frees_gathered_here() -> list[bool]:
    from fsdp_compose._runtime.state import state_of

    model = TinyLM()
    shard_blocks_then_root(model)
    group = state_of(model.blocks[0]).group
    on = group.process_group
    return [group._frees_gathered(on, torch.empty(2)), group._frees_gathered(on, torch.empty(2, device="meta"))]


def test_only_a_cpu_buffer_on_gloo_is_freed_at_the_copy_out():
    """gloo's CPU buffers only: a device buffer's last reference frees it (the caching allocator's stream order
    needs that), and other backends hold no finished work on a thread of their own."""
    assert run_on_ranks(2, _frees_gathered_here) == [[True, False]] * 2
