"""register_fsdp_forward_method: a non-forward method runs with unsharded parameters."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_compose import register_fsdp_forward_method
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import SEQ, VOCAB, TinyLM, shard_blocks_then_root


class GenerativeLM(TinyLM):
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Like forward, but not forward: uses the root's own parameters directly."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def generate(self, ids: torch.Tensor, new_tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding; returns the tokens and the last step's logits."""
        for _ in range(new_tokens):
            last = self.logits(ids)[:, -1]
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
        return ids, last


def _all_resharded(model: torch.nn.Module) -> bool:
    return all(s.group.unsharded_nbytes() == 0 for m in model.modules() if (s := state_of(m)) is not None)


def _generate_like_unsharded() -> dict:
    torch.manual_seed(0)
    reference = GenerativeLM()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    checks: dict[str, object] = {}

    # Unregistered, the root's embedding weight is still a sharded DTensor inside generate.
    try:
        with torch.no_grad():
            model.generate(ids)
        checks["unregistered_fails"] = False
    except RuntimeError as error:
        checks["unregistered_fails"] = "mixed torch.Tensor and DTensor" in str(error)
    model.reshard()

    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model, "generate")  # idempotent
    with torch.no_grad():  # no forward has run before: generate triggers the lazy init
        tokens, last = model.generate(ids)
        ref_tokens, ref_last = reference.generate(ids)
    checks["same_tokens"] = torch.equal(tokens, ref_tokens)
    checks["logits_diff"] = (last - ref_last).abs().max().item()
    checks["resharded_after_generate"] = _all_resharded(model)
    checks["params_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())

    # With grad: the method also takes part in backward (gradients reduce-scattered).
    register_fsdp_forward_method(model, "logits")
    batch = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(7))  # same on all ranks
    for m in (model, reference):
        out = m.logits(batch[:, :-1])
        F.cross_entropy(out.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    ref_grads = dict(reference.named_parameters())
    checks["grad_diff"] = max(
        (p.grad.full_tensor() - ref_grads[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    checks["resharded_after_backward"] = _all_resharded(model)

    try:
        register_fsdp_forward_method(model, "decode")
        checks["missing_method_raises"] = False
    except ValueError:
        checks["missing_method_raises"] = True
    return checks


def test_generate_matches_unsharded_model():
    for checks in run_on_ranks(2, _generate_like_unsharded):
        assert checks.pop("logits_diff") <= 1e-5
        assert checks.pop("grad_diff") <= 1e-5
        assert all(checks.values()), checks


def test_unsharded_module_is_a_no_op():
    # Same model code with or without fully_shard: nothing to register on a plain module.
    model = GenerativeLM()
    register_fsdp_forward_method(model, "generate")
    assert "generate" not in vars(model)
