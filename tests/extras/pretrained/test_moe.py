"""Mixture-of-experts checkpoints: one tensor per expert on disk, one fused 3-D parameter in the model.

transformers 5 writes Mixtral's and Qwen2-MoE's experts one tensor each (``block_sparse_moe.experts.0.w1.weight``,
``mlp.experts.0.gate_proj.weight``) while its models hold ``mlp.experts.gate_up_proj`` and ``down_proj``; its
``from_pretrained`` converts between them. ``load_pretrained`` applies the same conversions straight into the
shards: every parameter's full value equals ``from_pretrained``'s bit for bit and so do the logits, and each
rank reads exactly the bytes of its own shards (the experts it holds, not the others'). ``save_pretrained``
writes the layout transformers writes (the same tensor names), which ``from_pretrained`` reloads to the sharded
model's logits and values. Also with the experts on a mesh of their own (``ShardPlacementResult``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks

VOCAB, SEQ, PER_RANK = 64, 8, 2


def _config(family: str):
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
    return transformers.Qwen2MoeConfig(  # 3 experts: one each at 3 ranks; a shared expert besides
        intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=3, **common
    )


def _ids(world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=torch.Generator().manual_seed(7))


def _load_save(family: str, ckpt: str, out: str, placement: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    from fsdp_compose import ShardPlacementResult, fully_shard, load_pretrained, save_pretrained
    from fsdp_compose.extras.pretrained.checkpoint_dir import read_checkpoint

    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:  # the layout transformers writes: one tensor per expert, several files
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(ckpt, max_shard_size="20KB")
    dist.barrier()
    written = read_checkpoint(ckpt)
    reference = AutoModelForCausalLM.from_pretrained(ckpt).eval()

    options = {}
    if placement == "experts_apart":  # experts replicated over a (2, 1) mesh of their own, the rest sharded
        experts = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        options["shard_placement_fn"] = lambda p: ShardPlacementResult(Shard(0), experts) if p.dim() == 3 else None
    if placement == "shard1":  # each expert's rows split: a rank holds the end of w1's and the start of w3's
        options["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 3 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(family))
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, **options)
    fully_shard(model)
    result = load_pretrained(model, ckpt)
    model.eval()
    ids = _ids(world)
    expected = reference.state_dict()
    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # may alias a replicated shard
    values_differ = sorted(n for n in expected if n not in full or not torch.equal(full[n], expected[n]))
    with torch.no_grad():
        loaded_logits = model(input_ids=ids).logits
        reference_logits = reference(input_ids=ids).logits
    shard_bytes = sum(p.to_local().numel() * p.dtype.itemsize for p in model.parameters())
    total = torch.tensor([result.bytes_read])
    dist.all_reduce(total)
    experts_held = [tuple(p.to_local().shape)[0] for n, p in model.named_parameters() if n.endswith("experts.down_proj")]

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    local = ids[rank * PER_RANK : (rank + 1) * PER_RANK]
    model(input_ids=local, labels=local).loss.backward()  # one step: the save holds new values
    optimizer.step()
    model.eval()
    save_pretrained(model, out, max_shard_size="20KB", shared_filesystem=placement != "not_shared")
    with torch.no_grad():
        trained_logits = model(input_ids=ids).logits
    trained = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    report = {
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "values_differ": values_differ,
        "names": sorted(full) == sorted(expected),
        "logits_equal": torch.equal(loaded_logits, reference_logits),
        "bytes_read": result.bytes_read,
        "shard_bytes": shard_bytes,
        "total_read": total.item(),
        "checkpoint_bytes": sum(e.nbytes for e in written.values()),
        "experts_held": experts_held,
    }
    if rank == 0:  # transformers reads the export in one process
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        state = reloaded.state_dict()
        with torch.no_grad():
            report["reloaded_logits_equal"] = torch.equal(reloaded(input_ids=ids).logits, trained_logits)
        report["reloaded_values_differ"] = sorted(n for n, v in trained.items() if not torch.equal(state[n], v))
        report["saved_names_match"] = sorted(read_checkpoint(out)) == sorted(written)
    dist.barrier()
    return report


@pytest.mark.parametrize(
    "family, world, placement",
    [
        ("mixtral", 2, "shared"),
        ("mixtral", 3, "not_shared"),  # 4 experts over 3 ranks: 2, 2, 0; rank 0 writes the files
        ("qwen2_moe", 2, "not_shared"),
        ("qwen2_moe", 3, "shared"),  # 3 experts over 3 ranks: one each
        ("mixtral", 2, "experts_apart"),
        ("qwen2_moe", 3, "shard1"),
    ],
)
def test_moe_checkpoint_into_shards_and_back(family, world, placement, tmp_path) -> None:
    pytest.importorskip("transformers")
    results = run_on_ranks(world, _load_save, family, str(tmp_path / "hf"), str(tmp_path / "out"), placement, timeout=300)
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == [], r
        assert r["names"] and r["values_differ"] == [], r["values_differ"]
        assert r["logits_equal"], "right after loading, the logits differ from from_pretrained's"
        assert r["bytes_read"] == r["shard_bytes"], r  # fp32 file, fp32 parameters: exactly its shards' bytes
    if placement != "experts_apart":  # (there each rank holds, and reads, every expert: a replica)
        assert results[0]["total_read"] == results[0]["checkpoint_bytes"]  # every byte read once across the ranks
    if placement in ("shared", "not_shared"):
        experts = _config(family).num_local_experts if family == "mixtral" else _config(family).num_experts
        rows = [len(chunk) for chunk in torch.arange(experts).chunk(world)] + [0] * world  # as fully_shard cuts them
        assert [r["experts_held"][0] for r in results] == rows[:world]  # e.g. 2, 2, 0 for 4 experts at 3 ranks
    first = results[0]
    assert first["reloaded_logits_equal"] and first["reloaded_values_differ"] == [], first
    assert first["saved_names_match"], "save_pretrained did not write the names transformers writes"


def test_layouts_give_the_boxes_transformers_operations_make() -> None:
    """transformers' own operations run on ``Layout``s: any box of the result is the sources' boxes they name."""
    pytest.importorskip("transformers")
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    from fsdp_compose.extras.pretrained.layout import Leaf, full_box, slices

    def run(ops, inputs, sources, targets):
        for op in ops:
            inputs = op.convert(inputs, source_patterns=sources, target_patterns=targets)
        return inputs

    def assemble(layout, box, values):
        out = torch.full([size for _, size in box], float("nan"))
        for piece in layout.pieces(box):
            source = values[piece.source]
            out[slices(piece.box, box)] = piece.arrange(source[slices(piece.source_box, full_box(source.shape))])
        return out

    experts, rows, hidden = 5, 3, 4
    values = {f"{kind}{e}": torch.randn(rows, hidden) for kind in "gu" for e in range(experts)}
    fuse = [MergeModulelist(0), Concatenate(1)]  # Mixtral's and Qwen2-MoE's gate_up_proj
    tensors = {k: [values[f"{k}{e}"] for e in range(experts)] for k in "gu"}
    leaves = {k: [Leaf(f"{k}{e}", (rows, hidden)) for e in range(experts)] for k in "gu"}
    fused = run(fuse, tensors, ["g", "u"], ["t"])["t"]
    layout = run(fuse, leaves, ["g", "u"], ["t"])["t"]
    assert layout.shape == fused.shape
    boxes = [((1, 2), (0, 6), (0, 4)), ((0, 5), (2, 3), (1, 2)), ((4, 1), (5, 1), (3, 1)), ((2, 0), (0, 6), (0, 4))]
    for box in boxes:
        assert torch.equal(assemble(layout, box, values), fused[slices(box, full_box(fused.shape))]), box
    # reversed, as save_pretrained runs them: the model's tensor into one tensor per expert, and a rank's part
    split = [op.reverse_op for op in fuse[::-1]]
    per_expert = run(split, {"t": fused}, ["t"], ["g.*", "u.*"])
    per_expert_layouts = run(split, {"t": Leaf("t", fused.shape)}, ["t"], ["g.*", "u.*"])
    assert per_expert.keys() == per_expert_layouts.keys() and len(per_expert) == 2 * experts
    held = ((2, 2), (0, 6), (0, 4))  # a rank's rows: experts 2 and 3
    for name, tensor in per_expert.items():
        pieces = per_expert_layouts[name].pieces(full_box(tensor.shape))
        assert torch.equal(assemble(per_expert_layouts[name], full_box(tensor.shape), {"t": fused}), tensor)
        parts = [p.within(held) for p in pieces]
        assert (int(name.split(".")[1]) in (2, 3)) == any(parts), name  # it holds experts 2 and 3 only
    moved = run([Transpose(1, 2)], {"t": [fused]}, ["t"], ["x"])["x"]
    moved_layout = run([Transpose(1, 2)], {"t": [Leaf("t", fused.shape)]}, ["t"], ["x"])["x"]
    box = ((1, 3), (1, 2), (2, 3))
    assert torch.equal(assemble(moved_layout, box, {"t": fused}), moved[slices(box, full_box(moved.shape))])


def test_an_expert_missing_from_the_checkpoint_is_refused_by_name(tmp_path) -> None:
    """One process, unsharded: an expert's tensor missing gives an error naming the tensors, before any load."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from fsdp_compose import PretrainedCheckpointError, load_pretrained

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "whole")
    tensors = load_file(tmp_path / "whole" / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "lacking.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_config(_config("mixtral"))
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(PretrainedCheckpointError, match=r"lacking.safetensors: 'model.layers.1.mlp.experts.gate_up_proj' from .* more do not convert.*\[4, 24, 16\] and \[3, 24, 16\]"):
        load_pretrained(model, str(tmp_path / "lacking.safetensors"))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # untouched
    load_pretrained(model, str(tmp_path / "whole"))  # and unsharded, the whole checkpoint loads as transformers does
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    assert all(torch.equal(p, reference.get_parameter(name)) for name, p in model.named_parameters())
