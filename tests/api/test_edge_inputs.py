"""Edge inputs either train at parity or raise a clear error naming the parameter (issue 12, item 5).

Each case runs on 2 gloo ranks against the unsharded model on the global batch (fp32 <= 1e-5)
for 3 AdamW steps. Where torch's FSDP2 (2.13) differs, the case's docstring says how.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import fully_shard
from tests.harness import run_on_ranks
from tests.models import max_grad_diff, max_param_diff, mean_across_ranks

PER_RANK = 2


def _parity(build, step, shard=None, steps: int = 3) -> float:
    """Largest loss/grad/param difference between the sharded model and the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    (shard or (lambda m: fully_shard(m)))(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    worst = 0.0
    for i in range(steps):
        batch = torch.randn(world * PER_RANK, 4, generator=torch.Generator().manual_seed(i))
        ref_loss = step(reference, batch)
        loss = step(model, batch[rank * PER_RANK : (rank + 1) * PER_RANK])
        worst = max(worst, abs(mean_across_ranks(loss) - ref_loss.item()), max_grad_diff(model, reference))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return max(worst, max_param_diff(model, reference))


def _plain_step(model, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss


# ----- parameter shapes ---------------------------------------------------------------------
class Odd(nn.Module):
    """dim 0 of 1 (< world size), an empty parameter and a transposed (non-contiguous) one."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(4, 1)  # weight (1, 4), bias (1,): fewer rows than ranks
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.transposed = nn.Parameter(torch.randn(5, 4).t())  # (4, 5), strides (1, 4)

    def forward(self, x):
        return self.narrow(x) + (x @ self.transposed).sum(1, keepdim=True) + self.empty.sum()


def _odd_shapes(world: int) -> float:
    assert not Odd().transposed.is_contiguous()
    return _parity(Odd, _plain_step)


@pytest.mark.parametrize("world", [2, 3])
def test_small_empty_and_transposed_parameters_train_at_parity(world):
    """dim 0 smaller than the world size, an empty and a non-contiguous parameter.

    Both libraries pad rows up to the world size; parity here is against the unsharded model.
    """
    assert max(run_on_ranks(world, _odd_shapes, world)) <= 1e-5


def _zero_dim() -> str:
    model = nn.Linear(4, 2)
    model.scale = nn.Parameter(torch.tensor(2.0))
    try:
        fully_shard(model)
    except ValueError as error:
        return str(error)
    return "sharded"


def test_zero_dim_parameter_is_refused_by_name():
    """Refused at ``fully_shard`` time; torch's FSDP2 refuses it there too, also by name."""
    message = run_on_ranks(2, _zero_dim)[0]
    assert "0-dim parameter 'scale'" in message, message


# ----- outputs and inputs -------------------------------------------------------------------
@dataclass
class Out:
    value: torch.Tensor
    label: str


class Structured(nn.Module):
    """Returns a dict holding a dataclass, a nested tuple with non-tensor entries, and None."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 3)
        self.outer = nn.Linear(3, 2)

    def forward(self, x, *, scale: float = 1.0, bias: torch.Tensor | None = None):
        h = self.inner(x) * scale
        if bias is not None:
            h = h + bias
        return {"out": Out(self.outer(h), "y"), "aux": (h, ("text", 3, None)), "none": None}


class NoTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return None


class WithNoTensorChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logger = NoTensor()
        self.structured = Structured()

    def forward(self, x):
        self.logger(x)
        return self.structured(x, scale=0.5, bias=torch.ones(3))  # keyword-only inputs, one a tensor


def _structured_step(model, batch):
    out = model(batch)
    loss = out["out"].value.pow(2).mean() + out["aux"][0].mean()
    loss.backward()
    return loss


def _structured() -> float:
    def shard(model):
        fully_shard(model.logger)
        fully_shard(model.structured.inner)
        fully_shard(model.structured)
        fully_shard(model)

    return _parity(WithNoTensorChild, _structured_step, shard)


def test_structured_outputs_keyword_inputs_and_tensorless_modules():
    """dict/dataclass/nested-tuple outputs with str/int/None leaves, a module returning None,
    keyword-only inputs. The logger's parameters get no gradient and stay as they were.

    Found here: a tensor inside a dataclass output got no pre-backward hook (pytree does not
    enter dataclasses), so backward hit freed parameters ("setStorage: ... storage of size
    0"); _runtime/hooks/forward.py's output_tensors now walks dataclass fields, as torch's FSDP2 does.
    """
    assert max(run_on_ranks(2, _structured)) <= 1e-5


# ----- step protocol ------------------------------------------------------------------------
def _retain_graph_step(model, batch):
    loss = model(batch).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()  # gradients accumulate twice, as without sharding
    return loss


def _eval_between_step(model, batch):
    model.eval()
    with torch.no_grad():
        model(batch)
    model(batch).sum()  # eval-mode forward with grad, no backward
    model.train()
    return _plain_step(model, batch)


def _step_before_backward() -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    before = [p.full_tensor().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()  # no gradients yet: nothing changes
    return max((p.full_tensor() - b).abs().max().item() for p, b in zip(model.parameters(), before))


def _build_two_layers():
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))


def _shard_two(model):
    fully_shard(model[0])
    fully_shard(model)


def _protocol() -> list[float]:
    return [
        _parity(_build_two_layers, _retain_graph_step, _shard_two),
        _parity(_build_two_layers, _eval_between_step, _shard_two),
        _step_before_backward(),
    ]


def test_retain_graph_eval_no_grad_and_step_before_backward():
    """``backward(retain_graph=True)`` twice, eval and ``no_grad`` forwards between steps,
    and ``optimizer.step()`` before any backward all behave as without sharding."""
    for diffs in run_on_ranks(2, _protocol):
        assert max(diffs) <= 1e-5, diffs
