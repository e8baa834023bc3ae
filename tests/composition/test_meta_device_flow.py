"""torchtitan's flow: a llama-like model built on the meta device, sharded, materialized, trained with a chunked loss.

The flow, as torchtitan's llama3 runs it:

- build the model under ``torch.device("meta")``; each attention keeps its RoPE cache as a
  non-persistent buffer computed by ``_precompute_rope_cache`` (on meta: no data yet);
- ``fully_shard`` the embedding, each block, ``[norm, output]`` together with
  ``reshard_after_forward=False``, then the root (which is left with no parameters of its own);
- ``model.to_empty(device="cpu")`` and ``model.init_weights()`` under ``torch.no_grad()``;
- each step: the root's forward returns the hidden states; the output group is gathered once
  (``unshard()``), the loss runs over sequence chunks with one ``backward()`` each (gradient
  sync of the output group off for all but the last), then ``reshard()`` and the backward of
  the body from the hidden states' gradient.

Random init: on a CPU mesh DTensor's random ops draw the same local values on every rank, so
``nn.init.*`` on the sharded parameters would repeat the first shard everywhere. ``init_weights``
therefore runs the per-module initializer through ``fsdp_compose.init_sharded_parameters``
(each module's parameters at full size, this rank's rows kept), which on an unsharded model is
a plain init in ``model.modules()`` order: the reference built eagerly and initialized with the
same seed gets exactly the same values (checked below, bit for bit).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import fully_shard, init_sharded_parameters
from tests.harness import run_on_ranks
from tests.models import max_grad_diff, max_param_diff, mean_across_ranks

VOCAB, DIM, HEADS, HIDDEN, SEQ, N_LAYERS = 37, 12, 2, 22, 9, 2
CHUNKS, STEPS, PER_RANK = 3, 3, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _precompute_rope_cache(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """(seq, head_dim // 2, 2): cos and sin of each position's rotation angles."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (batch, seq, heads, head_dim) by the cached angles."""
    pairs = x.unflatten(-1, (-1, 2))
    cos, sin = cache[: x.shape[1], None, :, 0], cache[: x.shape[1], None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.register_buffer("rope_cache", _precompute_rope_cache(self.head_dim, SEQ), persistent=False)

    def init_weights(self) -> None:
        self.rope_cache = _precompute_rope_cache(self.head_dim, SEQ)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:2], HEADS, self.head_dim)
        q = apply_rope(self.wq(x).view(shape), self.rope_cache).transpose(1, 2)
        k = apply_rope(self.wk(x).view(shape), self.rope_cache).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def init_own_parameters(module: nn.Module) -> None:
    """Initialize ``module``'s own parameters (not its children's)."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(N_LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def init_weights(self) -> None:
        """RoPE caches, then every parameter (random init that also works on a CPU mesh, see the module docstring)."""
        for layer in self.layers:
            layer.attention.init_weights()
        init_sharded_parameters(self, init_own_parameters)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states; the chunked loss applies ``norm`` and ``output``."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def shard_like_torchtitan(model: Transformer) -> None:
    fully_shard(model.tok_embeddings)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.norm, model.output], reshard_after_forward=False)
    fully_shard(model)


def build_sharded() -> Transformer:
    with torch.device("meta"):
        model = Transformer()
    shard_like_torchtitan(model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        model.init_weights()
    return model


def build_reference() -> Transformer:
    reference = Transformer()
    torch.manual_seed(1)
    with torch.no_grad():
        reference.init_weights()
    return reference


def reference_step(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model.output(model.norm(model(tokens[:, :-1])))
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss


def chunked_step(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """One step of torchtitan-style chunked loss: CHUNKS + 1 backward passes."""
    targets = tokens[:, 1:]
    hidden = model(tokens[:, :-1])
    detached = hidden.detach().requires_grad_()
    model.norm.unshard()  # the output group, gathered once for every chunk
    total = torch.zeros(())
    for i, (h, t) in enumerate(zip(detached.chunk(CHUNKS, dim=1), targets.chunk(CHUNKS, dim=1))):
        model.norm.set_requires_gradient_sync(i == CHUNKS - 1, recurse=False)
        logits = model.output(model.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum") / targets.numel()
        loss.backward()
        total += loss.detach()
    model.norm.reshard()
    hidden.backward(detached.grad)
    return total


def _train_chunked() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_sharded()
    torch.manual_seed(0)
    reference = build_reference()
    init_diff = max_param_diff(model, reference)
    buffers_equal = all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers(), strict=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses, grad_diffs = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 + step)
            batch = torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=gen)
            ref_losses.append(reference_step(reference, batch).item())
            local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
            losses.append(mean_across_ranks(chunked_step(model, local)))
            grad_diffs.append(max_grad_diff(model, reference))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    return {
        "init_diff": init_diff,
        "buffers_equal": buffers_equal,
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_diff": max(grad_diffs),
        "param_diff": max_param_diff(model, reference),
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_torchtitan_meta_init_and_chunked_loss_match_reference(world_size):
    for r in run_on_ranks(world_size, _train_chunked):
        assert r["init_diff"] == 0.0 and r["buffers_equal"]  # sharded init == eager init, bit for bit
        for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(ours - ref) <= 1e-5, (r["losses"], r["ref_losses"])
        assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert not [m for m in r["warnings"] if "order" in m or "fsdp_compose" in m], r["warnings"]


def _meta_buffers_after_root() -> dict:
    with torch.device("meta"):
        model = Transformer()
        model.register_buffer("root_cache", torch.empty(3), persistent=False)
    shard_like_torchtitan(model)
    after_root = {name: b.device.type for name, b in model.named_buffers()}
    model.to_empty(device="cpu")
    return {"after_root": after_root, "after_to_empty": {name: b.device.type for name, b in model.named_buffers()}}


def test_root_call_leaves_meta_buffers_to_to_empty():
    results = run_on_ranks(2, _meta_buffers_after_root)
    assert results[1] == results[0]  # every rank
    result = results[0]
    assert result["after_root"] == {
        "root_cache": "meta",
        "layers.0.attention.rope_cache": "meta",
        "layers.1.attention.rope_cache": "meta",
    }
    assert set(result["after_to_empty"].values()) == {"cpu"}, result


def _order_change_in_chunked_steps() -> list[str]:
    """Two steps in order, then the layers swapped on every rank: a real change, warned once."""
    model = build_sharded()
    gen = torch.Generator().manual_seed(7)
    batch = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                model.layers = nn.ModuleList(list(model.layers)[::-1])
            chunked_step(model, batch)
        model(batch[:, :-1])  # the last step's order is compared when the next one begins
    return [str(w.message) for w in caught]


def test_a_changed_order_across_chunked_steps_still_warns_once():
    results = run_on_ranks(2, _order_change_in_chunked_steps)
    assert results[1] == results[0]  # every rank warns, once
    messages = results[0]
    assert_expected_inline(
        "\n".join(messages),
        """fsdp_compose: the forward order of sharded modules differs from the first iteration at position 2 ('layers.1' (TransformerBlock) instead of 'layers.0' (TransformerBlock)); forward prefetch follows the first order, so overlap may suffer""",
    )
