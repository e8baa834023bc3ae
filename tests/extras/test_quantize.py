"""``quantize_all_gather``: weights travel as int8 / float8 blocks with a scale each (ZeRO++'s qwZ).

The reference is the same model unsharded whose chosen weights are rounded exactly as the wire
rounds them (each rank's padded rows, flattened into blocks, one absmax scale per block) with a
straight-through gradient; the sharded model must match it to fp32 rounding, in every
composition. A second check bounds the drift from unquantized training.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, explain, fully_shard, quantize_all_gather
from tests.harness import run_on_ranks
from tests.messages import message
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference

BLOCK = 16


def wire_round(w: torch.Tensor, ranks: int, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """``w`` as every rank sees it after a quantized gather over ``ranks`` shard ranks."""
    rows = math.ceil(w.shape[0] / ranks)
    out = []
    for chunk in torch.chunk(w.detach().float(), ranks) + (w.new_zeros(0, *w.shape[1:]),) * ranks:
        if len(out) == ranks:
            break
        padded = torch.zeros(rows, *w.shape[1:])
        padded[: chunk.shape[0]] = chunk
        flat = padded.reshape(-1)
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
        largest = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
        scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / largest
        scaled = flat / scale
        q = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
        out.append((q.float() * scale).reshape(-1)[: padded.numel()].view_as(padded)[: chunk.shape[0]])
    return w + (torch.cat(out).to(w.dtype) - w).detach()


class RoundedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, wire_round(self.weight, self.ranks, self.wire_dtype), self.bias)


class RoundedEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, wire_round(self.weight, self.ranks, self.wire_dtype))


def rounded_reference(ranks: int, dtype: torch.dtype) -> TinyLM:
    model = TinyLM()
    for module in model.modules():
        swap = {nn.Linear: RoundedLinear, nn.Embedding: RoundedEmbedding}.get(type(module))
        if swap is not None:
            module.__class__ = swap
            module.ranks, module.wire_dtype = ranks, dtype
    return model


def _parity(dtype_name: str, shard_ranks: int, **shard_kwargs):
    dtype = getattr(torch, dtype_name)
    checkpointed = shard_kwargs.pop("checkpoint", False)
    if shard_kwargs.pop("hsdp", False):
        shard_kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def sharded() -> TinyLM:
        torch.manual_seed(0)
        model = TinyLM()
        chosen = quantize_all_gather(model, dtype, block_size=BLOCK, min_numel=0)
        assert chosen == ["embed.weight", "blocks.0.fc1.weight", "blocks.0.fc2.weight"] + [
            f"blocks.{i}.fc{j}.weight" for i in (1, 2) for j in (1, 2)
        ] + ["head.weight"], chosen
        shard_blocks_then_root(model, **shard_kwargs)
        if checkpointed:  # recomputed in backward from the re-gathered (and again dequantized) weights
            for block in model.blocks:
                block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)
        return model

    return train_against_reference(lambda: rounded_reference(shard_ranks, dtype), None, sharded=sharded)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_the_rounding_the_wire_does(dtype, world_size):
    assert_parity(run_on_ranks(world_size, _parity, dtype, world_size))


@pytest.mark.parametrize(
    "case, world_size, shard_ranks, kwargs",
    [
        pytest.param("reshard to 2 of 4 ranks", 4, 4, {"reshard_after_forward": 2}, marks=pytest.mark.slow),
        pytest.param("HSDP 2x2", 4, 2, {"hsdp": True}, marks=pytest.mark.slow),
        ("no reshard, CPU offload", 3, 3, {"reshard_after_forward": False, "offload_policy": CPUOffloadPolicy()}),
        ("activation checkpointing", 2, 2, {"checkpoint": True}),
    ],
)
def test_composes(case, world_size, shard_ranks, kwargs):
    assert_parity(run_on_ranks(world_size, _parity, "int8", shard_ranks, **kwargs))


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _bf16_tiny_lm(quantized: bool) -> TinyLM:
    """TinyLM sharded with bf16 compute, its weights travelling as int8 blocks of ``BLOCK`` if ``quantized``."""
    torch.manual_seed(0)
    model = TinyLM()
    if quantized:
        quantize_all_gather(model, block_size=BLOCK, min_numel=0)
    shard_blocks_then_root(model, mp_policy=BF16)
    return model


def _bf16_drift_and_bytes():
    from tests.models import global_batch, lm_loss, local_slice, mean_across_ranks

    curves, gathered = [], []
    for quantized in (False, True):
        model = _bf16_tiny_lm(quantized)
        plan = explain(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for step in range(6):
            import torch.distributed as dist

            batch = local_slice(global_batch(step, dist.get_world_size()), dist.get_rank(), dist.get_world_size())
            loss = lm_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(mean_across_ranks(loss))
        block = fully_shard.state(model.blocks[0]).group
        assert block.stats.all_gather_bytes == 6 * plan.groups[1].all_gather_bytes, (block.stats, plan.groups[1])
        curves.append(curve)
        gathered.append(block.stats.all_gather_bytes)
    return curves, gathered


def test_bf16_drift_is_small():
    for curves, _ in run_on_ranks(2, _bf16_drift_and_bytes):
        plain, quantized = curves
        assert max(abs(a - b) / a for a, b in zip(plain, quantized)) < 0.01, curves


def _gathered_bytes() -> dict:
    """One bf16 step's all-gathers, plain and int8, as the process group receives them (data travels as
    uint8): TinyLM at blocks of 16, and one 512x512 weight at the default block of 128 (the README's 0.52x)."""
    from tests.runtime.test_collectives import record_gathers

    out = {}
    for quantized in (False, True):
        model = _bf16_tiny_lm(quantized)
        with record_gathers() as gathers:
            lm_loss(model, torch.randint(0, 37, (2, 6))).backward()
        out["tiny", quantized] = [nbytes for _, dtype, nbytes in gathers if dtype == torch.uint8]
        big = nn.Linear(512, 512, bias=False)
        if quantized:
            quantize_all_gather(big, min_numel=0)
        fully_shard(big, mp_policy=BF16)
        with record_gathers() as gathers:
            big(torch.randn(2, 512)).sum().backward()
        out["big", quantized] = [nbytes for _, dtype, nbytes in gathers if dtype == torch.uint8]
    return out


def test_bytes_at_the_collective_are_the_wire_format():
    """Each rank sends its padded shard: a chosen weight as 1-byte blocks (the last padded) plus an
    fp32 scale per block, anything else at 2 bytes (bf16); computed here by hand from the shapes."""
    world = 2

    def rows(n):  # this rank's padded rows of n
        return -(-n // world)

    def int8(elements, block):  # data padded to whole blocks, then one fp32 scale per block
        return -(-elements // block) * (block + 4)

    def root(weight):  # embed and head weights; norm weight and bias, head bias at 2 bytes
        return 2 * weight(rows(37) * 13) + 2 * (rows(13) * 2 + rows(37))

    def block(weight):  # fc1 and fc2 weights; norm weight and bias, fc1 and fc2 biases at 2 bytes
        return weight(rows(29) * 13) + weight(rows(13) * 29) + 2 * (rows(13) * 2 + rows(29) + rows(13))

    def plain(elements):
        return 2 * elements

    def quantized(elements):
        return int8(elements, BLOCK)

    # forward: the root and three blocks; backward: the blocks again (resharded after forward)
    for got in run_on_ranks(world, _gathered_bytes):  # every rank
        assert got["tiny", False] == [world * root(plain)] + [world * block(plain)] * 6, got
        assert got["tiny", True] == [world * root(quantized)] + [world * block(quantized)] * 6, got
        ratio = sum(got["big", True]) / sum(got["big", False])
        assert ratio == (128 + 4) / 128 / 2, ratio  # 0.516: the README's "0.52x the bf16 bytes"


def test_bad_calls(single_rank_group):
    block = nn.Linear(4, 4)
    assert_expected_inline(
        message(lambda: quantize_all_gather(block, torch.float16)),
        """ValueError: quantize_all_gather(dtype=torch.float16): pick one of torch.int8, torch.float8_e4m3fn, torch.float8_e5m2""",
    )
    fully_shard(block)
    assert_expected_inline(
        message(lambda: quantize_all_gather(block, min_numel=0)),
        """ValueError: quantize_all_gather: parameter 'weight' is already sharded by fully_shard; call quantize_all_gather before fully_shard""",
    )
    from torch.distributed.tensor import Shard

    other = nn.Linear(4, 4)
    quantize_all_gather(other, min_numel=0)
    assert_expected_inline(
        message(lambda: fully_shard(other, shard_placement_fn=lambda p: Shard(1))),
        """NotImplementedError: parameter 'weight' has a quantized all-gather, which fully_shard supports on dim-0 shards of a data-parallel mesh only, not with Shard(1)""",
    )


def test_a_tied_weight_is_chosen_once():
    embed, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    assert quantize_all_gather(model, min_numel=0) == ["0.weight"]
    assert quantize_all_gather(model, filter_fn=lambda name, p: name == "1.weight") == ["1.weight"]


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_refresh_in_place_matches_and_holds_no_fp32_copy_of_the_weight(dtype):
    """Later unshards dequantize into the unsharded weight a few blocks at a time: the same bits
    as the first unshard's fresh tensor, without an fp32 copy of the whole weight (the backward's
    re-gathers happen at the activation peak; that copy put the quantized run's peak above the
    unquantized one's in benchmarks/bench_step.py --quantized)."""
    from fsdp_compose.extras.observe.storage import StorageTracker
    from fsdp_compose.extras.quantized_gather import BlockQuantized

    torch.manual_seed(0)
    ranks, weight = 3, torch.randn(1000, 300)  # 334 rows per rank: the last rank holds 2 padding rows
    codec = BlockQuantized(getattr(torch, dtype), block_size=128)
    sent = [codec.pre(chunk, _Mesh(ranks), weight.shape, None, None, None) for chunk in torch.chunk(weight, ranks)]
    shape = sent[0][1]
    outputs = tuple(torch.cat([inputs[i] for inputs, _ in sent]) for i in range(2))
    fresh, _ = codec.post(outputs, shape, torch.bfloat16)
    out = torch.full_like(weight, float("nan"), dtype=torch.bfloat16)
    with StorageTracker() as tracker:
        tracker.track([out, *outputs])
        before = tracker.current
        tracker.reset_peak()
        assert codec.post(outputs, shape, torch.bfloat16, out=out) is None
    assert torch.equal(out, fresh[: weight.shape[0]])
    relative = 1 / 127 if dtype == "int8" else 2**-4  # half a step, plus bf16's rounding, under these
    assert (out.float() - weight).abs().max() < relative * weight.abs().max()
    assert tracker.peak - before <= (1 << 16) * 4 < weight.numel() * 4, tracker.peak - before


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_requantizing_the_dequantized_weight_gives_the_bytes_sent(dtype, param_dtype):
    """The gathered 1-byte values are freed once dequantized; a reshard_after_forward=<int> slice cut
    later gets them back from the weight: exactly, since bf16's rounding of a dequantized value
    (2**-9 relative) is far inside half a quantization step."""
    from fsdp_compose.extras.quantized_gather import BlockQuantized

    torch.manual_seed(0)
    ranks, weight = 3, torch.randn(1000, 300) * torch.logspace(-8, 2, 1000).unsqueeze(1)  # 334 rows per rank
    codec = BlockQuantized(getattr(torch, dtype), block_size=128)
    sent = [codec.pre(chunk, _Mesh(ranks), weight.shape, None, None, None) for chunk in torch.chunk(weight, ranks)]
    shape = sent[0][1]
    data, scales = (torch.cat([inputs[i] for inputs, _ in sent]) for i in range(2))
    dequantized = codec.post((data, scales), shape, getattr(torch, param_dtype))[0][: weight.shape[0]]
    assert codec.rebuilds(dequantized.dtype)
    rebuilt = torch.full_like(data, 7)
    codec.requantize_into(rebuilt, scales, dequantized, shape)
    assert torch.equal(rebuilt.view(torch.uint8), data.view(torch.uint8))


class _WideLM(nn.Module):
    """An embedding and a head (the root's) that outweigh the blocks, as in a GPT: the root stays
    gathered from its forward to the end of the backward, beside the activations."""

    def __init__(self, vocab: int = 2048, dim: int = 64, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(n_blocks)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _peak_live_bytes(quantized: bool, batch: int = 4, seq: int = 32) -> int:
    """Tracked live bytes at a step's peak above what the step starts with (bf16 mixed precision)."""
    import torch.distributed as dist

    from fsdp_compose.extras.observe.storage import StorageTracker

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = _WideLM()
    if quantized:
        quantize_all_gather(model, torch.int8)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        ids = torch.randint(0, 2048, (batch, seq + 1), generator=torch.Generator().manual_seed(i + dist.get_rank()))
        F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # the first step builds the unsharded parameters and the optimizer state
    tracker = StorageTracker()
    tracker.track([*model.parameters(), *model.buffers()])
    tracker.track(t for state in optimizer.state.values() for t in state.values())
    with tracker:
        tracker.reset_peak()
        start = tracker.current
        step(1)
    return tracker.peak - start


def _peaks() -> dict[bool, int]:
    return {quantized: _peak_live_bytes(quantized) for quantized in (False, True)}


def test_peak_live_bytes_not_above_unquantized():
    """The root stays gathered through the step: its 1-byte values and scales kept beside the
    dequantized weights until reshard put the quantized peak above the unquantized one (+1.2% on
    benchmarks/bench_step.py's GPT). They are freed once dequantized; only the scales stay, for a
    reshard_after_forward=<int> slice the group cannot yet say it will not cut."""
    peaks = run_on_ranks(2, _peaks)
    for peak in peaks:
        assert peak[True] <= peak[False], peak  # was 264 KiB above: int8 256 + scales 8 (freed after dequantizing)
