"""Double backward through sharded blocks: a gradient penalty (``torch.autograd.grad(...,
create_graph=True)``, then ``.backward()`` through the graph it created) trains at parity.

Both torch's FSDP2 and fsdp_compose used to free the unsharded parameters at the end of the
gradient-only backward, which the created graph still reads: a crash (or wrong gradients) in the
step's backward. That backward now only gathers, and the groups stay gathered until the step's
backward ends (runtime/hooks/backward.py, ``begin_graph_only``).
"""

import pytest
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


def _train(reshard: bool, variant: str):
    def build():
        model = Critic(checkpointed=variant == "checkpointed")
        return freeze(model, {"blocks.0.fc1.weight"}) if variant == "frozen" else model

    def shard(model):
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)

    return train_against_reference(build, shard, step_fn=_penalty_step)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("variant", ["plain", "frozen", "checkpointed"])
def test_gradient_penalty_at_parity(reshard, variant):
    assert_parity(run_on_ranks(2, _train, reshard, variant))


def test_gradient_penalty_at_three_ranks():
    assert_parity(run_on_ranks(3, _train, True, "plain"))


def _without_the_private_check() -> str:
    """The fallback where torch lacks ``_will_engine_execute_node``: a clear error naming the group."""
    from fsdp_compose.runtime.hooks import backward

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
