"""Hugging Face transformers models (GPT-2, Llama, built from tiny configs) on fsdp_compose.

Needs the ``hf`` extra (``pip install torch==2.13.0 -e '.[test,hf]'``); skipped without it.
Every check runs on 2 gloo ranks against the same model trained unsharded on the global batch.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks
from tests.models import max_grad_diff, max_param_diff, mean_across_ranks

pytest.importorskip("transformers")

VOCAB, SEQ, PER_RANK = 64, 8, 2


def _config(kind: str):
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":  # tied input and output embeddings
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    return transformers.LlamaConfig(  # untied
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def _build(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(kind))


def _shard(model: nn.Module, **kwargs):
    """Auto-wrap by the decoder-layer classes the model names in ``_no_split_modules``."""
    from fsdp_compose import ModuleWrapPolicy, apply_fully_shard

    classes = {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}
    return apply_fully_shard(model, ModuleWrapPolicy(classes), **kwargs)


def _batch(step: int) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)
    return ids, ids[rank * PER_RANK : (rank + 1) * PER_RANK]


def _step(model: nn.Module, opt, ids: torch.Tensor, before_step=None) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: Adam's 1/sqrt(v) turns 1e-7 rounding in near-zero gradients into
    1e-4 parameter differences within a few steps, which would hide what this test compares."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_parity_and_resume(kind: str, ckpt_dir: str) -> dict:
    from fsdp_compose import load_checkpoint, save_checkpoint

    reference = _build(kind)
    model = copy.deepcopy(reference)
    plan = _shard(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    opt, ref_opt = _sgd(model), _sgd(reference)
    losses, ref_losses, grad_diffs = [], [], []
    for step in range(4):
        full, local = _batch(step)
        ref_loss = reference(input_ids=full, labels=full).loss
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        losses.append(mean_across_ranks(_step(model, opt, local, lambda: grad_diffs.append(max_grad_diff(model, reference)))))
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 1:
            save_checkpoint(ckpt_dir, model, opt, step=2)
    # a fresh sharded model resumes from the step-2 checkpoint and repeats steps 2 and 3
    resumed = _build(kind)
    _shard(resumed)
    resumed_opt = _sgd(resumed)
    start, _ = load_checkpoint(ckpt_dir, resumed, resumed_opt)
    resumed_losses = [mean_across_ranks(_step(resumed, resumed_opt, _batch(s)[1])) for s in range(start, 4)]
    return {
        "groups": [g.fqn for g in plan.groups],
        "tied": tied,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": max_param_diff(model, reference),
        "grad_diff": max(grad_diffs),
        "resumed_losses": resumed_losses,
        "resume_param_diff": max(
            (a.to_local() - b.to_local()).abs().max().item() if a.numel() else 0.0
            for a, b in zip(resumed.parameters(), model.parameters())
        ),
    }


@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_trains_at_parity_and_resumes_from_checkpoint(kind: str, tmp_path) -> None:
    results = run_on_ranks(2, _train_parity_and_resume, kind, str(tmp_path / "ckpt"))
    for r in results:
        assert len(r["groups"]) == 3 and r["groups"][-1] == "", r["groups"]  # two decoder layers, then the root
        assert r["tied"] == (kind == "gpt2")
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, r
        assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["resumed_losses"] == r["losses"][2:], r
        assert r["resume_param_diff"] == 0.0, r


def _mixed_precision() -> dict:
    from fsdp_compose import MixedPrecisionPolicy

    reference = _build("llama")
    model = copy.deepcopy(reference)
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diffs = []
    for step in range(2):
        full, local = _batch(step)
        ref_loss = _step(reference, ref_opt, full).item()
        diffs.append(abs(mean_across_ranks(_step(model, opt, local)) - ref_loss))
    dtypes = {p.dtype for p in model.parameters()}
    return {"loss_diffs": diffs, "dtypes": dtypes, "param_diff": max_param_diff(model, reference)}


def test_llama_bf16_mixed_precision_tracks_fp32_reference() -> None:
    for r in run_on_ranks(2, _mixed_precision):
        assert r["dtypes"] == {torch.float32}  # fp32 master weights
        assert max(r["loss_diffs"]) < 2e-2, r  # bf16 compute: close, not equal
        assert 0 < r["param_diff"] < 5e-2, r


def _generate_and_export(kind: str, out_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from fsdp_compose import full_state_dict, register_fsdp_forward_method

    reference = _build(kind)
    model = copy.deepcopy(reference)
    _shard(model)
    register_fsdp_forward_method(model, "generate")
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=prompt).logits

    sd = full_state_dict(model)  # every rank calls it; rank 0 gets CPU tensors, the others {}
    result = {"generate_equal": torch.equal(generated, expected), "sd_empty_elsewhere": not sd}
    if dist.get_rank() == 0:
        keys = len(sd)
        model.save_pretrained(out_dir, state_dict=dict(sd))  # save_pretrained empties the dict it gets
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
        with torch.no_grad():
            result["logits_equal"] = torch.equal(reloaded(input_ids=prompt).logits, logits)
        result["sd_kept"] = len(sd) == keys
        result["sd_emptied_by_save"] = _save_empties(model, sd, out_dir + "-again")
        result["sd_empty_elsewhere"] = True
    dist.barrier()
    return result


def _save_empties(model: nn.Module, sd: dict, out_dir: str) -> bool:
    model.save_pretrained(out_dir, state_dict=sd)
    return not sd


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generate_and_save_pretrained_round_trip(kind: str, tmp_path) -> None:
    results = run_on_ranks(2, _generate_and_export, kind, str(tmp_path / "export"))
    assert all(r["generate_equal"] and r["sd_empty_elsewhere"] for r in results), results
    assert results[0]["logits_equal"] and results[0]["sd_kept"], results[0]
    assert results[0]["sd_emptied_by_save"]  # the gotcha docs/huggingface.md warns about
    assert os.path.exists(tmp_path / "export" / "config.json")


def _accelerate_parity() -> dict:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from fsdp_compose import FSDPModule
    from fsdp_compose_compat import use_as_torch_fsdp

    reference = _build("gpt2")
    with use_as_torch_fsdp():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"]
        )
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        PartialState().distributed_type = DistributedType.FSDP  # CPU-only: accelerate would pick DDP; later
        accelerator.state.distributed_type = DistributedType.FSDP  # AcceleratorState()s copy PartialState's
        accelerator.state.fsdp_plugin = plugin
        model = copy.deepcopy(reference)
        model, opt = accelerator.prepare(model, _sgd(model))  # accelerate re-points the optimizer at the shards
        ref_opt = _sgd(reference)
        sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        losses, ref_losses, grad_diffs = [], [], []
        for step in range(3):
            full, local = _batch(step)
            ref_loss = reference(input_ids=full, labels=full).loss
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
            loss = model(input_ids=local, labels=local).loss
            accelerator.backward(loss)
            losses.append(mean_across_ranks(loss.detach()))
            grad_diffs.append(max_grad_diff(model, reference))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        still_fsdp2 = accelerator.is_fsdp2
    AcceleratorState._reset_state(True)
    return {
        "still_fsdp2": still_fsdp2,
        "sharded": sharded,
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_diff": max(grad_diffs),
        "param_diff": max_param_diff(model, reference),
    }


def test_accelerate_fsdp2_through_use_as_torch_fsdp_at_parity() -> None:
    pytest.importorskip("accelerate")
    for r in run_on_ranks(2, _accelerate_parity):
        # accelerate's plan: each GPT2Block, the tied (final norm, wte, lm_head) group, the root
        assert r["still_fsdp2"]  # PartialState set too: the optimizer wrapper's AcceleratorState() kept FSDP
        assert r["sharded"] == ["", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"], r["sharded"]
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, r
        assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
