"""load_pretrained / save_pretrained in any model state: a load after a forward with grad and no backward
lands everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks

pytest.importorskip("transformers")
WORLD = 2
TIMEOUT_S = 300


def _config():
    from tests.ecosystem.test_huggingface import _config as tiny_config

    return tiny_config("llama")


def _base_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> None:
    """Rank 0 writes a tiny Llama with transformers (seed 0); the others wait."""
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(), dtype=dtype).save_pretrained(path)
    dist.barrier()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _load_after_forward_with_grad(ckpt: str, dtype: torch.dtype) -> dict:
    """An eval pass with grad enabled and no backward, then a load: every later forward runs the loaded weights."""
    from transformers import AutoModelForCausalLM

    from fsdp_compose import fully_shard, load_pretrained

    _base_checkpoint(ckpt, dtype)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prompt = _prompt()
    model(input_ids=prompt)  # grad enabled, no backward: the root stays unsharded
    load_pretrained(model, ckpt)
    with torch.no_grad():
        expected = reference(input_ids=prompt).logits
        forwards = [torch.equal(model(input_ids=prompt).logits, expected) for _ in range(3)]
    shards = all(torch.equal(v, reference.state_dict()[n]) for n, v in _full(model).items())
    losses = []
    for m in (model, reference):  # one training step on the loaded weights, the same batch on every rank
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(input_ids=prompt, labels=prompt).loss.backward()
        optimizer.step()
        losses.append(m(input_ids=prompt, labels=prompt).loss.item())
    return {"forwards": forwards, "shards": shards, "losses": losses}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_after_a_forward_with_grad_lands_everywhere(dtype, tmp_path) -> None:
    for r in run_on_ranks(WORLD, _load_after_forward_with_grad, str(tmp_path / "base"), dtype, timeout=TIMEOUT_S):
        assert r["forwards"] == [True, True, True], r
        assert r["shards"], "the shards differ from the file"
        assert abs(r["losses"][0] - r["losses"][1]) < 1e-5, r
