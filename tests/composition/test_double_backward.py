"""Double backward through sharded blocks: a gradient penalty (``torch.autograd.grad(...,
create_graph=True)``, then ``.backward()`` through the graph it created) trains at parity.

Both torch's FSDP2 and fsdp_compose used to free the unsharded parameters at the end of the
gradient-only backward, which the created graph still reads: a crash (or wrong gradients) in the
step's backward. That backward now only gathers, and the groups stay gathered until the step's
backward ends (_runtime/hooks/backward.py, ``begin_graph_only``).
"""

import pytest
from expecttest import assert_expected_inline
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_compose import fully_shard
from tests.harness import run_on_ranks
from tests.models import Block, assert_parity, freeze, train_against_reference

DIM = 6


class Critic(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim=DIM, hidden=29) for _ in range(2))
        self.out = nn.Linear(DIM, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.out(x)


def _penalty_step(model, batch, rank, world_size):
    """A per-sample loss, so the mean over ranks of the slices' losses is the global batch's."""
    x = (batch[:, :DIM].float() / 37).requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = out.mean() + 10 * g.pow(2).sum(dim=1).mean()
    loss.backward()
    return loss.detach()


def _train(reshard: bool, variant: str, step_fn=_penalty_step):
    def build():
        model = Critic(checkpointed=variant == "checkpointed")
        return freeze(model, {"blocks.0.fc1.weight"}) if variant == "frozen" else model

    def shard(model):
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)

    return train_against_reference(build, shard, step_fn=step_fn)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("variant", ["plain", "frozen", "checkpointed"])
def test_gradient_penalty_at_parity(reshard, variant):
    assert_parity(run_on_ranks(2, _train, reshard, variant))


def test_gradient_penalty_at_three_ranks():
    assert_parity(run_on_ranks(3, _train, True, "plain"))


def _without_the_private_check() -> str:
    """The fallback where torch lacks ``_will_engine_execute_node``: a clear error naming the group."""
    from fsdp_compose._runtime.hooks import backward

    saved, backward._will_execute_node = backward._will_execute_node, None
    try:
        torch.manual_seed(0)
        model = Critic()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        try:
            _penalty_step(model, torch.randint(0, 37, (2, 7)), 0, 1)
        except RuntimeError as error:
            return str(error)
        return "no error"
    finally:
        backward._will_execute_node = saved


def test_without_the_private_check_the_error_names_the_group():
    (message,) = run_on_ranks(1, _without_the_private_check)
    assert message.startswith("a backward with create_graph=True reached '<root>' (Critic); telling"), message



def _backward_twice(model, batch, rank, world_size):
    """``loss.backward(create_graph=True)``, then ``loss.backward()`` again through the same graph."""
    loss = model(batch[:, :DIM].float() / 37).pow(2).mean()
    loss.backward(create_graph=True)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("reshard", [True, False])
def test_a_second_backward_through_a_create_graph_backward_at_parity(reshard):
    assert_parity(run_on_ranks(2, _train, reshard, "plain", _backward_twice))


def _backward_through_the_gradients() -> str:
    """``backward(create_graph=True)``, then a loss of the parameters' gradients and its backward:
    torch's gradients lead back to the parameters; ours were reduce-scattered, which has no derivative."""
    torch.manual_seed(0)
    model = Critic()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model(torch.randn(4, DIM)).pow(2).sum().backward(create_graph=True)
    try:
        sum(p.grad.pow(2).sum() for p in model.parameters()).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_backward_through_reduced_gradients_names_the_module():
    """It failed with torch's "element 0 of tensors does not require grad" (nothing named); now every
    rank says which group's gradients it reached and why they carry no graph."""
    messages = run_on_ranks(2, _backward_through_the_gradients)
    assert len(set(messages)) == 1, messages  # every rank, the same
    assert_expected_inline(messages[0], """a backward reached the gradients of 'blocks.1' (Block) made by backward(create_graph=True): they were reduce-scattered across ranks, which autograd cannot differentiate, so they lead back to no parameter. For a gradient penalty take the gradients with torch.autograd.grad(out, inputs, create_graph=True) before the step's backward (docs/composition.md)""")
