"""Execution order, prefetch, the in-flight limit, and the cross-rank order check."""

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from fsdp_compose._runtime.group import ParamGroup
from fsdp_compose._checks.order import ExecutionOrderError
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference


def sharded_lm(n_blocks: int = 3) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(n_blocks=n_blocks)
    shard_blocks_then_root(model)
    return model


def first_step(model: TinyLM) -> torch.Tensor:
    """One forward/backward, which records the reference order; returns the batch."""
    ids = torch.randint(0, 37, (2, 6))
    lm_loss(model, ids).backward()
    return ids


@contextmanager
def trace_unshards():
    """Record, in order, each all-gather actually issued and each one actually waited for."""
    events = []
    start, wait = ParamGroup.start_unshard, ParamGroup.wait_unshard

    def traced_start(group):
        if not group.is_unsharded and group.pending_unshard is None:
            events.append(f"gather {group.label}")
        start(group)

    def traced_wait(group):
        if group.pending_unshard is not None:
            events.append(f"  wait {group.label}")
        wait(group)

    ParamGroup.start_unshard, ParamGroup.wait_unshard = traced_start, traced_wait
    try:
        yield events
    finally:
        ParamGroup.start_unshard, ParamGroup.wait_unshard = start, wait


def _trace_second_step():
    """What is issued and waited, in order, once the first step recorded the order."""
    model = sharded_lm()
    ids = first_step(model)
    root = state_of(model).root
    recorded = {
        "forward": [s.group.label for s in root.reference_forward_order],
    }
    with trace_unshards() as events:
        loss = lm_loss(model, ids)
        events.append("-- backward")
        recorded["post_forward"] = [s.group.label for s in root.post_forward_order]
        loss.backward()
    return recorded, events


def test_recorded_order_drives_prefetch():
    results = run_on_ranks(2, _trace_second_step)
    assert results[1] == results[0]  # every rank records and prefetches alike
    recorded, events = results[0]
    assert_expected_inline(
        "\n".join(recorded["forward"]) + "\n|\n" + "\n".join(recorded["post_forward"]),
        """\
'<root>' (TinyLM)
'blocks.0' (Block)
'blocks.1' (Block)
'blocks.2' (Block)
|
'blocks.0' (Block)
'blocks.1' (Block)
'blocks.2' (Block)
'<root>' (TinyLM)""",
    )
    # each group's all-gather is issued one group ahead of its wait, right after the previous
    # group's copy-out (so two gather buffers never coexist)
    assert_expected_inline(
        "\n".join(events),
        """\
gather '<root>' (TinyLM)
  wait '<root>' (TinyLM)
gather 'blocks.0' (Block)
  wait 'blocks.0' (Block)
gather 'blocks.1' (Block)
  wait 'blocks.1' (Block)
gather 'blocks.2' (Block)
  wait 'blocks.2' (Block)
-- backward
gather 'blocks.2' (Block)
  wait 'blocks.2' (Block)
gather 'blocks.1' (Block)
  wait 'blocks.1' (Block)
gather 'blocks.0' (Block)
  wait 'blocks.0' (Block)""",
    )


def _trace_with_compute(prefetch_limit: int) -> list[str]:
    """The second step's all-gathers and waits, between markers of compute: the embedding's and each
    block's fc1 forward, and each fc1's output gradient in backward."""
    model = sharded_lm()
    ids = first_step(model)
    state_of(model).root.prefetch_limit = prefetch_limit
    with trace_unshards() as events:

        def mark(name):
            def on_forward(module, args, output):
                events.append(f"compute {name}")
                if output.requires_grad:
                    output.register_hook(lambda grad: events.append(f"compute {name} (grad)"))

            return on_forward

        model.embed.register_forward_hook(mark("embed"))
        for i, block in enumerate(model.blocks):
            block.fc1.register_forward_hook(mark(f"blocks.{i}"))
        loss = lm_loss(model, ids)
        events.append("-- backward")
        loss.backward()
    return events


def test_next_group_is_gathered_while_this_one_computes():
    """Prefetch and overlap (README: "prefetched one group ahead"): block k+1's all-gather is issued
    before block k computes and waited after, in forward and in backward. With prefetch off
    (``prefetch_limit = 0``) every all-gather follows the compute before it, so the trace differs."""
    for events in run_on_ranks(2, _trace_with_compute, 1):
        assert_expected_inline(
            "\n".join(events),
            """\
gather '<root>' (TinyLM)
  wait '<root>' (TinyLM)
gather 'blocks.0' (Block)
compute embed
  wait 'blocks.0' (Block)
gather 'blocks.1' (Block)
compute blocks.0
  wait 'blocks.1' (Block)
gather 'blocks.2' (Block)
compute blocks.1
  wait 'blocks.2' (Block)
compute blocks.2
-- backward
gather 'blocks.2' (Block)
  wait 'blocks.2' (Block)
gather 'blocks.1' (Block)
compute blocks.2 (grad)
  wait 'blocks.1' (Block)
gather 'blocks.0' (Block)
compute blocks.1 (grad)
  wait 'blocks.0' (Block)
compute blocks.0 (grad)
compute embed (grad)""",
        )
    for events in run_on_ranks(2, _trace_with_compute, 0):  # the control: each gather after the compute before it
        assert events.index("gather 'blocks.1' (Block)") > events.index("compute blocks.0"), events
        assert events.index("gather 'blocks.1' (Block)", events.index("-- backward")) > events.index(
            "compute blocks.2 (grad)"
        ), events


def _in_flight_peak(n_blocks):
    """Sample, during forward and backward compute, how many blocks hold gathered data."""
    model = sharded_lm(n_blocks)
    blocks = [state_of(b).group for b in model.blocks]
    samples = []

    def sample(*_):
        samples.append(sum(1 for g in blocks if g.unsharded_nbytes() > 0 or g.pending_unshard is not None))

    def on_fc1_output(module, args, output):
        sample()
        if output.requires_grad:
            output.register_hook(lambda grad: sample())

    for block in model.blocks:
        block.fc1.register_forward_hook(on_fc1_output)
    ids = torch.randint(0, 37, (2, 6))
    for _ in range(3):
        lm_loss(model, ids).backward()
    return max(samples), len(samples)


def test_in_flight_limit_bounds_unsharded_groups():
    for peak, count in run_on_ranks(2, _in_flight_peak, 6):
        assert count == 3 * 2 * 6
        assert peak == 2  # the running block and the one prefetched: never more


def _diverging_order():
    """Rank 1 runs the (identically sized) blocks in reverse: must raise, not train (the order check
    compares group ids, so equal sizes do not hide it)."""
    model = sharded_lm()
    if dist.get_rank() == 1:
        model.blocks = torch.nn.ModuleList(list(model.blocks)[::-1])
    shards = [p for m in model.modules() if (s := state_of(m)) for p in s.group.params]
    before = [p.local_tensor().clone() for p in shards]
    try:
        lm_loss(model, torch.randint(0, 37, (2, 6))).backward()
    except ExecutionOrderError as error:
        unchanged = all(torch.equal(b, p.local_tensor()) for b, p in zip(before, shards))
        return str(error), unchanged and all(p.sharded_param.grad is None for p in shards)
    return "no error", False


def test_ranks_running_different_orders_raise_everywhere():
    results = run_on_ranks(2, _diverging_order)
    assert all(unchanged for _, unchanged in results)  # no step taken, no gradient produced
    # rank 1 reordered its own module tree, so it names the same groups by its own paths
    assert "rank 0: all-gather of 'blocks.2' (Block)" in results[1][0]
    assert "rank 1: all-gather of 'blocks.0' (Block)" in results[1][0]
    assert_expected_inline(
        results[0][0],
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'blocks.0' (Block), 1736 bytes
  rank 1: all-gather of 'blocks.2' (Block), 1736 bytes""",
    )


def _order_change_warns_once():
    model = sharded_lm()
    ids = first_step(model)
    model.blocks = torch.nn.ModuleList(list(model.blocks)[::-1])  # every rank changes the same way
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            lm_loss(model, ids).backward()
    return [str(w.message) for w in caught if "fsdp_compose" in str(w.message)]


def test_local_order_change_warns_once():
    results = run_on_ranks(2, _order_change_warns_once)
    assert results[1] == results[0]  # every rank warns, once
    messages = results[0]
    assert_expected_inline(
        "\n".join(messages),
        """fsdp_compose: the forward order of sharded modules differs from the first iteration at position 1 ('blocks.2' (Block) instead of 'blocks.0' (Block)); forward prefetch follows the first order, so overlap may suffer""",
    )


def _explicit_prefetch():
    """Two blocks ahead in forward, two behind in backward, set by hand (torch FSDP2's API)."""
    def shard(model):
        shard_blocks_then_root(model)
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])

    result = train_against_reference(lambda: TinyLM(n_blocks=4), shard)
    torch.manual_seed(0)
    model = TinyLM(n_blocks=4)
    shard(model)
    with trace_unshards() as events:
        loss = lm_loss(model, torch.randint(0, 37, (2, 6)))
        events.append("-- backward")
        loss.backward()
    result["events"] = events
    return result


def test_explicit_prefetch():
    results = run_on_ranks(2, _explicit_prefetch)
    assert_parity(results)
    assert results[1]["events"] == results[0]["events"]  # every rank
    # the first step has no recorded order: only the explicit lists prefetch
    assert_expected_inline(
        "\n".join(results[0]["events"]),
        """\
gather '<root>' (TinyLM)
  wait '<root>' (TinyLM)
gather 'blocks.0' (Block)
  wait 'blocks.0' (Block)
gather 'blocks.1' (Block)
gather 'blocks.2' (Block)
  wait 'blocks.1' (Block)
gather 'blocks.3' (Block)
  wait 'blocks.2' (Block)
  wait 'blocks.3' (Block)
-- backward
gather 'blocks.3' (Block)
  wait 'blocks.3' (Block)
gather 'blocks.2' (Block)
gather 'blocks.1' (Block)
  wait 'blocks.2' (Block)
gather 'blocks.0' (Block)
  wait 'blocks.1' (Block)
  wait 'blocks.0' (Block)""",
    )
