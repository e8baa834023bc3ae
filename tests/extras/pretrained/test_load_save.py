"""load_pretrained / save_pretrained: Hugging Face checkpoints straight into shards and back out.

Against transformers' own ``from_pretrained``: right after loading, the sharded model's logits equal it bit
for bit (a meta-built Llama's rotary buffers included); after 3 training steps, what ``save_pretrained``
wrote reloads in transformers, in one process, to the sharded model's logits and full values, bitwise.
Each rank reads only its rows: the bytes read, summed over the ranks, are the checkpoint's tensor bytes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks

VOCAB, SEQ, PER_RANK = 64, 8, 2


def _config(kind: str):
    """test_huggingface's tiny configs: GPT-2 tied, Llama untied; 64 vocabulary rows, uneven at 3 ranks."""
    from tests.ecosystem.test_huggingface import _config as tiny_config

    return tiny_config(kind)


def _write_hf_checkpoint(kind: str, path: str) -> None:
    """Rank 0 writes a bf16 checkpoint with transformers in several files; the others wait."""
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(kind), dtype=torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    dist.barrier()


def _ids(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.randint(0, vocab, (world * PER_RANK, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return ids, ids[rank * PER_RANK : (rank + 1) * PER_RANK]


def _roundtrip(kind: str, ckpt: str, out: str, param_dtype: torch.dtype, options: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from fsdp_compose import fully_shard, load_pretrained, save_pretrained
    from fsdp_compose.extras.pretrained.checkpoint_dir import read_checkpoint

    _write_hf_checkpoint(kind, ckpt)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=param_dtype)
    with torch.device("meta"):  # how large models are built: no values until the load
        model = AutoModelForCausalLM.from_config(_config(kind), dtype=param_dtype)
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    result = load_pretrained(model, ckpt)
    vocab = model.config.vocab_size
    full, local = _ids(0, vocab)
    with torch.no_grad():
        loaded_equal = torch.equal(model(input_ids=full).logits, reference(input_ids=full).logits)
    bytes_read = torch.tensor([result.bytes_read])
    dist.all_reduce(bytes_read)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        _, local = _ids(step, vocab)
        model(input_ids=local, labels=local).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_pretrained(model, out, max_shard_size="30KB", **({"shared_filesystem": False} if kind == "gpt2" else {}))
    with torch.no_grad():
        trained_logits = model(input_ids=full).logits
    full_values = {name: p.full_tensor() for name, p in model.named_parameters()}
    report = {
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "loaded_equal": loaded_equal,
        "bytes_read": bytes_read.item(),
        "checkpoint_bytes": sum(e.nbytes for e in read_checkpoint(ckpt).values()),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "dtypes": {p.dtype for p in model.parameters()},
    }
    if dist.get_rank() == 0:  # transformers reads the export in one process
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        state = reloaded.state_dict()
        with torch.no_grad():
            report["reloaded_equal"] = torch.equal(reloaded(input_ids=full).logits, trained_logits)
        report["values_equal"] = all(torch.equal(state[name], value) for name, value in full_values.items())
        report["reloaded_dtype"] = reloaded.dtype
        report["files"] = sorted(os.listdir(out))
    dist.barrier()
    return report


def _shard_dim_1(param: nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.dim() == 2 else Shard(0)


@pytest.mark.parametrize(
    "kind, world, dtype, options",
    [
        # uneven rows (3 ranks), fp32 parameters from a bf16 file, a meta-built model's rotary buffers
        pytest.param("llama", 3, torch.float32, "plain", marks=pytest.mark.slow),
        # one rank: bf16 read straight into the shards' bytes
        pytest.param("llama", 1, torch.bfloat16, "plain", marks=pytest.mark.slow),
        # tied embeddings, bf16 parameters, Shard(1), CPU offload, mixed precision; saved the non-shared way
        ("gpt2", 2, torch.bfloat16, "shard1_offload_mp"),
    ],
)
def test_load_train_save_matches_transformers(kind, world, dtype, options, tmp_path) -> None:
    pytest.importorskip("transformers")
    from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {}
    if options == "shard1_offload_mp":
        kwargs = {
            "shard_placement_fn": _shard_dim_1,
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        }
    results = run_on_ranks(world, _roundtrip, kind, str(tmp_path / "hf"), str(tmp_path / "out"), dtype, kwargs)
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == [], r
        assert r["loaded_equal"], "right after loading, the logits differ from from_pretrained's"
        assert r["bytes_read"] == r["checkpoint_bytes"], r  # every byte read once across the ranks
        assert r["tied"] == (kind == "gpt2")
        assert r["dtypes"] == {dtype}
    first = results[0]
    assert first["reloaded_equal"] and first["values_equal"], first
    assert first["reloaded_dtype"] == dtype
    assert "config.json" in first["files"] and "model.safetensors.index.json" in first["files"], first["files"]
    assert "generation_config.json" in first["files"]


def _tp_and_hsdp(ckpt: str, out: str) -> dict:
    """A two-layer MLP, tensor parallel + FSDP on a (2, 2) mesh, then HSDP 2x2: loads and saves bitwise."""
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_compose import fully_shard, load_pretrained, save_pretrained

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(10, 14), nn.ReLU(), nn.Linear(14, 6))

    torch.manual_seed(0)
    values = {k: v.to(torch.bfloat16) for k, v in build().state_dict().items()}
    if dist.get_rank() == 0:
        save_file(values, os.path.join(ckpt))
    dist.barrier()
    report = {}
    for layout in ("tp", "hsdp"):
        with torch.device("meta"):
            model = build()
        if layout == "tp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
        else:
            fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        load_pretrained(model, ckpt)
        loaded = {name: p.full_tensor() for name, p in model.named_parameters()}
        report[f"{layout}_loaded"] = all(torch.equal(loaded[k], v.float()) for k, v in values.items())
        save_pretrained(model, os.path.join(out, layout))
        if dist.get_rank() == 0:
            saved = load_file(os.path.join(out, layout, "model.safetensors"))
            report[f"{layout}_saved"] = all(torch.equal(saved[k], loaded[k]) for k in values) and saved.keys() == values.keys()
        dist.barrier()
    return report


def test_tensor_parallel_and_hsdp_load_and_save_bitwise(tmp_path) -> None:
    pytest.importorskip("safetensors")
    results = run_on_ranks(4, _tp_and_hsdp, str(tmp_path / "mlp.safetensors"), str(tmp_path / "out"))
    assert all(r["tp_loaded"] and r["hsdp_loaded"] for r in results), results
    assert results[0]["tp_saved"] and results[0]["hsdp_saved"], results[0]
