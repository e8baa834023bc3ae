"""Issue 40, item 1: an optimizer built before ``fully_shard`` fails at its first step, on every rank,
naming a parameter and the fix; without the check, two steps change nothing, in silence."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdp_compose._checks import optimizer as optimizer_check
from tests.harness import run_on_ranks
from tests.models import TinyLM, full_value, global_batch, lm_loss, local_slice, shard_blocks_then_root


def _optimizer_first(check: bool) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the mistake: before fully_shard
    shard_blocks_then_root(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out = {"error": None}
    if not check:  # what happens without the check (as marked already checked): the mistake passes in silence
        setattr(optimizer, optimizer_check._CHECKED_ATTR, len(optimizer.param_groups))
    try:
        for step in range(2):
            lm_loss(model, local_slice(global_batch(step, world), rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        out["error"] = str(error)
    out["unchanged"] = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    # built after fully_shard, the same optimizer trains
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_loss(model, local_slice(global_batch(0, world), rank, world)).backward()
    optimizer.step()
    out["trains_when_built_after"] = not all(
        torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters()
    )
    out["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_an_optimizer_built_before_fully_shard_fails_at_its_first_step():
    for out in run_on_ranks(2, _optimizer_first, True):  # every rank
        assert out["error"].startswith(
            "SGD.step(): the optimizer holds parameter 'embed.weight' of '<root>' (TinyLM), which fully_shard "
            "replaced by its sharded DTensor"
        ), out["error"]
        assert "Build the optimizer after fully_shard" in out["error"]
        assert out["unchanged"] and out["trains_when_built_after"] and out["sharded"], out


def test_without_the_check_the_mistake_trains_nothing():
    for out in run_on_ranks(2, _optimizer_first, False):
        assert out["error"] is None and out["unchanged"], out


def _root_left_unsharded(how: str) -> dict:
    import warnings

    import torch.distributed as dist

    from fsdp_compose import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    if how == "frozen":
        for p in [*model.embed.parameters(), *model.norm.parameters(), *model.head.parameters()]:
            p.requires_grad_(False)
    for block in model.blocks:
        fully_shard(block)
    if how == "root sharded":
        fully_shard(model)
    elif how == "ignored":
        fully_shard(model, ignored_params={*model.embed.parameters(), *model.norm.parameters(), *model.head.parameters()})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm_loss(model, local_slice(global_batch(0, world), rank, world)).backward()
        optimizer.step()
    head = full_value(model.head.weight.detach()).clone()
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head)
    return {
        "warnings": [str(w.message) for w in caught if "no fully_shard manages" in str(w.message)],
        "heads_equal": all(torch.equal(h, heads[0]) for h in heads),
    }


def test_trainable_parameters_no_fully_shard_manages_warn_at_the_first_step():
    """Issue 40, item 2: the blocks sharded, the root not: its embedding, norm and head train on each
    rank's own gradients, and the heads differ after one step. A warning on every rank (an error would
    break torch's replicate() or a user's own all-reduce, which keep such parameters in step)."""
    for out in run_on_ranks(2, _root_left_unsharded, "root unsharded"):
        assert len(out["warnings"]) == 1 and not out["heads_equal"], out
        assert out["warnings"][0].startswith(
            "SGD.step(): the optimizer trains 5 parameter(s) no fully_shard manages next to sharded ones "
            "(shapes (37, 13), (13,), (13,), (37, 13), ...)"
        ), out["warnings"]
        assert "Call fully_shard on the root too" in out["warnings"][0]
    for how in ("root sharded", "ignored", "frozen"):  # the fixes, and what is meant to stay local: silent
        for out in run_on_ranks(2, _root_left_unsharded, how):
            assert out["warnings"] == [], (how, out)
            assert out["heads_equal"] == (how != "ignored"), (how, out)


def _valid_mixes() -> dict:
    """Issue 51, item 2: programs the checks must leave silent; each flow's warnings and errors."""
    import warnings

    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    from fsdp_compose import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = local_slice(global_batch(0, world), rank, world)
    out = {}

    def flow(name, run):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run()
                out[name] = [str(w.message) for w in caught if "fully_shard" in str(w.message)]
            except RuntimeError as error:
                out[name] = [str(error)]

    def blocks_only() -> TinyLM:
        torch.manual_seed(0)
        model = TinyLM()
        for block in model.blocks:
            fully_shard(block)
        return model

    def all_reduced_by_hand():  # the root's own parameters kept in step by the user's all-reduce
        model = blocks_only()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        lm_loss(model, batch).backward()
        for p in [*model.embed.parameters(), *model.norm.parameters(), *model.head.parameters()]:
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()

    def replicated():  # torch's replicate() on the root's own modules, fully_shard on the blocks
        model = blocks_only()
        for module in (model.embed, model.norm, model.head):
            replicate(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        lm_loss(model, batch).backward()
        optimizer.step()

    def two_models():  # a second model, sharded and given its optimizer after the first one trained
        torch.manual_seed(0)
        first = TinyLM()
        shard_blocks_then_root(first)
        first_optimizer = torch.optim.AdamW(first.parameters(), lr=0.1)
        lm_loss(first, batch).backward()
        first_optimizer.step()
        torch.manual_seed(0)
        second = TinyLM()
        shard_blocks_then_root(second)
        second_optimizer = torch.optim.AdamW(second.parameters(), lr=0.1)
        for model, optimizer in ((first, first_optimizer), (second, second_optimizer), (first, first_optimizer)):
            lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()

    def after_reset_iter_state():  # a failed first step, reset_iter_state, then training goes on
        torch.manual_seed(0)
        model = TinyLM()
        shard_blocks_then_root(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = model.blocks[1].register_forward_hook(lambda *_: 1 / 0)
        try:
            lm_loss(model, batch).backward()
        except ZeroDivisionError:
            model.reset_iter_state()
        handle.remove()
        for _ in range(2):
            lm_loss(model, batch).backward()
            optimizer.step()

    for name, run in [
        ("all-reduced by hand", all_reduced_by_hand),
        ("replicate()", replicated),
        ("two models", two_models),
        ("after reset_iter_state", after_reset_iter_state),
    ]:
        flow(name, run)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_valid_programs_pass_the_checks_in_silence(world):
    for out in run_on_ranks(world, _valid_mixes):
        assert out == {
            "all-reduced by hand": [],
            "replicate()": [],
            "two models": [],
            "after reset_iter_state": [],
        }, out
