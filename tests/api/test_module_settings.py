"""torch FSDP2's remaining FSDPModule settings, on real gloo ranks against an unsharded reference."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import AllGather, MixedPrecisionPolicy, ReduceScatter, fully_shard, share_comm_ctx
from fsdp_compose._runtime.state import state_of, states_in
from tests.harness import run_on_ranks
from tests.messages import message
from tests.models import (
    Block,
    TinyLM,
    assert_parity,
    default_step,
    global_batch,
    lm_loss,
    local_slice,
    shard_blocks_then_root,
    train_against_reference,
)


# ----- gradient divide factor -----------------------------------------------------------
def _divide_factor(reduce_dtype, factor, alias):
    """Sharded grads with a divide factor vs the sum of every rank's local-loss gradient."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM(n_blocks=1)
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module in (model, model.blocks[0]):
            if alias:
                module.set_reduce_scatter_divide_factor(factor)
            else:
                module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)
    deprecated = any(issubclass(w.category, DeprecationWarning) for w in caught)
    batch = global_batch(0, world_size)
    lm_loss(model, local_slice(batch, rank, world_size)).backward()
    total = sum(lm_loss(reference, local_slice(batch, r, world_size)) for r in range(world_size))
    total.backward()
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        worst = max(worst, ((p.grad.full_tensor() - q.grad / factor).abs().max() / q.grad.abs().max()).item())
    return {"relative": worst, "deprecated_warned": deprecated}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_divide_factor_one_gives_sum_of_ranks_grads(reduce_dtype):
    tol = 1e-6 if reduce_dtype == torch.float32 else 1e-2
    for r in run_on_ranks(2, _divide_factor, reduce_dtype, 1.0, False):
        assert r["relative"] < tol, r


def test_deprecated_alias_divides_by_its_factor():
    for r in run_on_ranks(3, _divide_factor, torch.float32, 3.0, True):
        assert r["relative"] < 1e-6 and r["deprecated_warned"], r


# ----- recovery ---------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


def _raise_forward(module, args):
    raise Boom("forward")


def _raise_in_backward(module, args, output):
    def fail(grad):
        raise Boom("backward")

    output.register_hook(fail)


def _fail_then_reset(model, batch, rank, world_size, step_holder={"step": 0}):  # noqa: B006 - per process
    """Every sharded step first runs a step that fails mid-forward or mid-backward on every rank."""
    if state_of(model) is None:  # the reference never fails
        return default_step(model, batch, rank, world_size)
    step = step_holder["step"] = step_holder["step"] + 1
    model.set_requires_gradient_sync(False)  # accumulated gradients the failed step must drop
    lm_loss(model, batch).backward()
    model.set_requires_gradient_sync(True)
    if step % 2:  # fail inside the second block's forward, after the first block gathered
        handle = model.blocks[1].register_forward_pre_hook(_raise_forward)
    else:  # fail in backward once the head and later blocks reduced (or are reducing)
        handle = model.blocks[0].register_forward_hook(_raise_in_backward)
    with pytest.raises(Boom):
        lm_loss(model, batch).backward()
    handle.remove()
    model.reset_iter_state()
    for p in model.parameters():
        p.grad = None  # reductions that finished before the failure
    groups = [s.group for _, s in states_in(model)]
    assert not any(g.is_unsharded or g.pending_reduces or g.pending_unshard for g in groups)
    return default_step(model, batch, rank, world_size)


def _recovery():
    return train_against_reference(TinyLM, shard_blocks_then_root, step_fn=_fail_then_reset)


@pytest.mark.parametrize("world_size", [2, 3])
def test_reset_iter_state_recovers_to_parity(world_size):
    assert_parity(run_on_ranks(world_size, _recovery))


def test_reset_iter_state_refused_on_non_root(single_rank_group):
    model = TinyLM(n_blocks=1)
    shard_blocks_then_root(model)
    lm_loss(model, global_batch(0, 1)).backward()
    assert_expected_inline(
        message(model.blocks[0].reset_iter_state),
        """RuntimeError: reset_iter_state() must be called on the root FSDP module; Block ('blocks.0' (Block)) is not the root, '<root>' (TinyLM) is""",
    )


# ----- unshard in backward, unused params, buffers, separate reduce-scatter group --------
def _shard_embedding_separately(model):
    fully_shard(model.embed)
    shard_blocks_then_root(model)
    model.embed.set_unshard_in_backward(False)


def _unshard_in_backward():
    result = train_against_reference(TinyLM, _shard_embedding_separately, steps=3)
    torch.manual_seed(0)
    model = TinyLM()
    _shard_embedding_separately(model)
    stats = state_of(model.embed).group.stats
    before = stats.all_gathers
    lm_loss(model, global_batch(0, dist.get_world_size())).backward()
    result["embed_gathers_per_step"] = stats.all_gathers - before
    return result


def test_unshard_in_backward_false_skips_the_backward_all_gather():
    results = run_on_ranks(2, _unshard_in_backward)
    assert_parity(results)
    assert [r["embed_gathers_per_step"] for r in results] == [1, 1]  # forward only (2 by default)


class TwoExperts(nn.Module):
    """Each sample goes to expert ``ids[:, 0] % 2``: ranks may use different experts."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM(n_blocks=1)
        self.experts = nn.ModuleList(nn.Linear(13, 13) for _ in range(2))

    def forward(self, ids):
        x = self.lm.embed(ids)
        route = ids[:, :1, None] % 2
        for index, expert in enumerate(self.experts):
            if (route == index).any():  # an expert no local sample needs does not run at all
                x = x + torch.where(route == index, expert(x), 0)
        return self.lm.head(self.lm.norm(self.lm.blocks[0](x)))


def _expert_step(model, batch, rank, world_size):
    """Rank r's samples all go to expert r (at ws 2), so each rank leaves one expert unused."""
    batch = batch.clone()
    batch[:, 0] = 2 * torch.arange(len(batch)) // len(batch) if world_size == 1 else rank  # rank r -> expert r
    loss = lm_loss(model, batch)
    loss.backward()
    return loss


def _settings_parity(setting):
    def shard(model):
        blocks = [model.lm.blocks[0]] if isinstance(model, TwoExperts) else list(model.blocks)
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        if setting == "unused":
            model.set_reduce_scatter_unused_params(True)
        elif setting == "buffers":
            model.set_reduce_scatter_max_input_buffers(1)
        elif setting == "separate":
            model.set_separate_reduce_scatter_group()
            group = state_of(model).group
            assert group.settings.reduce_process_group not in (None, group.process_group)

    if setting == "unused":
        return train_against_reference(TwoExperts, shard, step_fn=_expert_step, steps=3)
    return train_against_reference(TinyLM, shard, steps=3)


@pytest.mark.parametrize("setting", ["unused", "buffers", "separate"])
def test_reduction_settings_keep_parity(setting):
    assert_parity(run_on_ranks(2, _settings_parity, setting))


def test_max_input_buffers_validation(single_rank_group):
    block = Block()
    fully_shard(block)
    assert_expected_inline(
        message(lambda: block.set_reduce_scatter_max_input_buffers(True)),
        """TypeError: Block.set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got bool""",
    )
    assert_expected_inline(
        message(lambda: block.set_reduce_scatter_max_input_buffers(0)),
        """ValueError: Block.set_reduce_scatter_max_input_buffers: max_input_buffers must be a positive int, got 0""",
    )
    assert_expected_inline(
        message(lambda: block.set_gradient_divide_factor(0)),
        """ValueError: Block.set_gradient_divide_factor(0): pass a positive finite number""",
    )


def _share_comm_ctx():
    first, second = Block(), Block()
    fully_shard(first)
    fully_shard(second)
    first.set_separate_reduce_scatter_group()
    share_comm_ctx([first, second])
    shared = state_of(second).group.settings.reduce_process_group is state_of(first).group.settings.reduce_process_group
    return {"shared": shared, "error": message(lambda: share_comm_ctx([first, nn.Linear(2, 2)]))}


def test_share_comm_ctx_shares_the_reduce_scatter_group():
    for r in run_on_ranks(2, _share_comm_ctx):
        assert r["shared"]
        assert_expected_inline(r["error"], """ValueError: share_comm_ctx expects a list of FSDPModules but got Linear""")


# ----- communication hooks ----------------------------------------------------------------
class CountingAllGather(AllGather):
    """All-gathers on its own process group and counts calls (quantizes nothing)."""

    def __init__(self, group):
        self.group, self.calls = group, 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=self.group, async_op=async_op)


class SeparateReduceScatter(ReduceScatter):
    def __init__(self, group):
        self.group, self.calls = group, 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=self.group, async_op=async_op)


def _custom_comms():
    side = dist.new_group(list(range(dist.get_world_size())))
    comms = []

    def shard(model):
        shard_blocks_then_root(model)
        for module in (model, *model.blocks):
            gather, scatter = CountingAllGather(side), SeparateReduceScatter(side)
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
            comms.append((state_of(module).group, gather, scatter))

    result = train_against_reference(TinyLM, shard, steps=3)
    result["counts_match"] = all(
        g.calls == group.stats.all_gathers and s.calls == group.stats.reduce_scatters > 0 for group, g, s in comms
    )
    return result


def test_custom_all_gather_and_reduce_scatter_on_a_separate_group():
    results = run_on_ranks(2, _custom_comms)
    assert_parity(results)
    assert all(r["counts_match"] for r in results)


def test_custom_comm_missing_a_method(single_rank_group):
    block = Block()
    fully_shard(block)

    class NoAllocate:
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return None

    assert_expected_inline(
        message(lambda: block.set_custom_all_gather(NoAllocate())),
        """TypeError: Block.set_custom_all_gather(NoAllocate): a custom collective needs the methods allocate(size, *, dtype, device) and __call__(output_tensor, input_tensor, group, ...); missing: allocate""",
    )


def _all_reduce_hook():
    """FSDP within each rank alone (1-rank shard groups); the hook all-reduces across ranks."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))["shard"]
    calls = []

    def hook(reduce_output):
        calls.append(reduce_output.numel())
        dist.all_reduce(reduce_output)

    def shard(model):
        shard_blocks_then_root(model, mesh=mesh)
        for module in (model, *model.blocks):
            module.set_all_reduce_hook(hook)
            module.set_gradient_divide_factor(dist.get_world_size())

    result = train_against_reference(TinyLM, shard, steps=3)
    result["hook_calls"] = len(calls)
    return result


def test_all_reduce_hook_replicates_across_ranks():
    results = run_on_ranks(2, _all_reduce_hook)
    assert_parity(results)
    assert [r["hook_calls"] for r in results] == [12, 12]  # 4 groups x 3 steps


# ----- accelerator-only settings on CPU ---------------------------------------------------
def test_accelerator_settings_on_cpu_say_what_they_do(single_rank_group):
    block = Block()
    fully_shard(block)
    assert_expected_inline(
        message(lambda: block.set_post_optim_event(torch.Event("cpu"))),
        """ValueError: Block.set_post_optim_event: this group computes on CPU, where there are no streams to order: the next forward's all-gathers already start after the optimizer step. Drop the call on CPU""",
    )
    assert_expected_inline(
        message(block.set_symm_mem_for_comm),
        """ValueError: Block.set_symm_mem_for_comm: symmetric memory needs the NCCL backend on CUDA; this group's process group uses gloo""",
    )
    assert_expected_inline(
        message(lambda: block.set_all_reduce_hook(lambda t: None, stream=object())),
        """ValueError: Block.set_all_reduce_hook: stream= needs an accelerator; this group computes on CPU, where the hook runs in program order: leave stream unset""",
    )
    with pytest.warns(UserWarning, match="the gloo process group provides no allocator on cpu"):
        block.set_allocate_memory_from_process_group_for_comm(True)
    assert_expected_inline(
        message(lambda: block.set_custom_all_gather(CountingAllGather(None))),
        """ValueError: Block.set_custom_all_gather: cannot be combined with set_allocate_memory_from_process_group_for_comm(True); turn that off first""",
    )
    out = block(torch.randn(2, 13))
    out.sum().backward()  # runs through the process-group-allocated collectives
    assert block.fc1.weight.grad is not None


# ----- every setter writes a field the settings declare ------------------------------------
def _setters_write_declared_fields():
    """Each setter's value lands on ``GroupSettings`` (``_set_on_states`` sets fields by name; the settings are
    slotted, so a misspelt one raises instead of adding an attribute and leaving the setting without effect)."""
    from fsdp_compose._runtime.settings import GroupSettings

    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    shard_blocks_then_root(model)
    block, other = model.blocks
    block.set_requires_gradient_sync(False)
    block.set_requires_all_reduce(False)
    block.set_reshard_after_backward(False)
    block.set_reshard_after_forward(False)
    block.set_modules_to_forward_prefetch([other])
    block.set_modules_to_backward_prefetch([other])
    block.set_is_last_backward(False)
    block.set_reduce_scatter_unused_params(False)
    block.set_reduce_scatter_max_input_buffers(3)
    block.set_unshard_in_backward(False)
    block.set_gradient_divide_factor(4.0)
    state = state_of(block)
    settings = state.settings
    values = {
        "requires_gradient_sync": settings.requires_gradient_sync,
        "requires_all_reduce": settings.requires_all_reduce,
        "reshard_after_backward": settings.reshard_after_backward,
        "reshard_after_forward": settings.reshard_after_forward,
        "reshard_after_forward_chosen": settings.reshard_after_forward_chosen,
        "forward_prefetch": settings.forward_prefetch == state_of(other).call_states,
        "backward_prefetch": settings.backward_prefetch == state_of(other).call_states,
        "is_last_backward": settings.is_last_backward,
        "reduce_buffers": settings.reduce_buffers,
        "unshard_in_backward": settings.unshard_in_backward,
        "gradient_divide_factor": settings.gradient_divide_factor,
    }
    try:
        block._set_on_states(False, reshard_after_fowrard=True)
        misspelt = None
    except AttributeError as error:
        misspelt = type(error).__name__
    return {
        "values": values,
        "shared": settings is state.group.settings and isinstance(settings, GroupSettings),
        "misspelt": misspelt,
    }


def test_setters_write_fields_the_settings_declare():
    (result,) = run_on_ranks(1, _setters_write_declared_fields)
    assert result["shared"] and result["misspelt"] == "AttributeError"
    assert result["values"] == {
        "requires_gradient_sync": False,
        "requires_all_reduce": False,
        "reshard_after_backward": False,
        "reshard_after_forward": False,
        "reshard_after_forward_chosen": True,
        "forward_prefetch": True,
        "backward_prefetch": True,
        "is_last_backward": False,
        "reduce_buffers": 3,
        "unshard_in_backward": False,
        "gradient_divide_factor": 4.0,
    }
