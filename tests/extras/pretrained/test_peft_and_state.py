"""load_pretrained / save_pretrained with peft models, with what a checkpoint lacks, and in any model state.

peft: a base checkpoint loads into a sharded LoRA model under peft's ``base_layer`` names and leaves the
adapters bitwise as peft initialized them; after training, ``save_pretrained`` writes what
``PeftModel.save_pretrained`` writes, and ``PeftModel.from_pretrained`` on an unsharded base gives the sharded
model's logits; ``merge_adapters=True`` writes what ``merge_and_unload`` gives. ``config.json`` names the
model's own class. ``strict=False`` initializes a meta-built model's missing tensors as the model does, from
rank 0's random state, and names them. A load after a forward with grad and no backward lands everywhere.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks

pytest.importorskip("transformers")
WORLD = 2
TIMEOUT_S = 300
TARGETS = ["q_proj", "v_proj"]


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


def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **kwargs)


def _peft_model(meta: bool = False, **lora):
    """A Llama wrapped by peft (seed 1: base weights unlike the checkpoint's), sharded by decoder layer."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_compose import fully_shard

    torch.manual_seed(1)
    with torch.device("meta" if meta else "cpu"):
        model = get_peft_model(AutoModelForCausalLM.from_config(_config()), _lora(**lora))
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, adapters


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _peft_roundtrip(ckpt: str, out: str) -> dict:
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_compose import load_pretrained, save_pretrained

    _base_checkpoint(ckpt)
    model, peft_init = _peft_model()
    result = load_pretrained(model, ckpt)  # strict: every base name found under base_layer's
    full = _full(model)
    reference = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    report = {
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "adapters_untouched": all(torch.equal(full[n], v) for n, v in peft_init.items()),
        "base_loaded": all(torch.equal(full[n], reference[n.removeprefix("base_model.model.").replace(".base_layer", "")])
                           for n in full if "lora_" not in n),
    }
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(2):  # lora_B leaves zero: the adapters change the logits
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=_prompt()).logits
    written = save_pretrained(model, os.path.join(out, "adapter"))
    save_pretrained(model, os.path.join(out, "merged"), merge_adapters=True)
    report["written"] = [os.path.basename(f) for f in written]
    if dist.get_rank() == 0:  # peft and transformers read both in one process
        adapter, merged = os.path.join(out, "adapter"), os.path.join(out, "merged")
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt), adapter)
        with torch.no_grad():
            report["logits_equal"] = torch.equal(reloaded(input_ids=_prompt()).logits, logits)
            with reloaded.disable_adapter():  # the trained adapters change the logits: the check means something
                report["adapters_matter"] = not torch.equal(reloaded(input_ids=_prompt()).logits, logits)
        report["files"] = sorted(os.listdir(adapter))
        report["keys_as_peft"] = sorted(load_file(os.path.join(adapter, "adapter_model.safetensors"))) == sorted(
            get_peft_model_state_dict(reloaded)
        )
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            report["adapter_config"] = json.load(f)
        unmerged = reloaded.merge_and_unload()
        merged_model = AutoModelForCausalLM.from_pretrained(merged)
        expected = unmerged.state_dict()
        report["merged_equal"] = all(torch.equal(v, expected[k]) for k, v in merged_model.state_dict().items())
        with open(os.path.join(merged, "config.json")) as f:
            report["merged_architectures"] = json.load(f)["architectures"]
        report["merged_files"] = sorted(os.listdir(merged))
    dist.barrier()
    return report


def test_peft_base_load_train_save_reloads_in_peft(tmp_path) -> None:
    pytest.importorskip("peft")
    results = run_on_ranks(WORLD, _peft_roundtrip, str(tmp_path / "base"), str(tmp_path / "out"), timeout=TIMEOUT_S)
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == [], r
        assert r["adapters_untouched"], "a base load changed the adapters peft initialized"
        assert r["base_loaded"], "the base weights differ from from_pretrained's"
        assert r["written"] == ["adapter_model.safetensors"], r["written"]
    first = results[0]
    assert first["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"], first["files"]
    assert first["keys_as_peft"], "the adapter file's names are not peft's"
    assert first["adapter_config"]["peft_type"] == "LORA" and first["adapter_config"]["inference_mode"]
    assert first["adapter_config"]["auto_mapping"]["base_model_class"] == "LlamaForCausalLM", first["adapter_config"]
    assert first["logits_equal"], "PeftModel.from_pretrained on the unsharded base gives other logits"
    assert first["adapters_matter"]
    assert first["merged_equal"], "merge_adapters=True differs from peft's merge_and_unload"
    assert first["merged_architectures"] == ["LlamaForCausalLM"]
    assert "model.safetensors" in first["merged_files"] and "adapter_config.json" not in first["merged_files"]


def _meta_peft(ckpt: str) -> dict:
    """A peft model built on meta: the base from the checkpoint, the LoRA adapters by peft's own reset."""
    from transformers import AutoModelForCausalLM

    from fsdp_compose import load_pretrained

    _base_checkpoint(ckpt, torch.bfloat16)
    model, _ = _peft_model(meta=True)
    load_pretrained(model, ckpt)
    full = _full(model)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    lora_a = [v for n, v in full.items() if "lora_A" in n]
    return {
        "base": all(torch.equal(v, reference[n.removeprefix("base_model.model.").replace(".base_layer", "")])
                    for n, v in full.items() if "lora_" not in n),
        "b_zero": all(not v.any() for n, v in full.items() if "lora_B" in n),
        "a_finite": all(v.isfinite().all() and v.abs().max() < 1 for v in lora_a),
        "a_sum": sum(v.double().sum().item() for v in lora_a),
    }


def test_meta_built_peft_model_gets_base_weights_and_peft_initialized_adapters(tmp_path) -> None:
    pytest.importorskip("peft")
    results = run_on_ranks(WORLD, _meta_peft, str(tmp_path / "base"), timeout=TIMEOUT_S)
    for r in results:
        assert r["base"] and r["b_zero"] and r["a_finite"], r
    assert results[0]["a_sum"] == results[1]["a_sum"]  # one initialisation, whichever rank holds the rows


def _modules_to_save(ckpt: str, out: str) -> dict:
    """``modules_to_save``: the base load fills the original and the copy; the copy, changed, is what the adapter
    file holds and what a merged save writes under the base name (no backward here: see the report)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp_compose import load_pretrained, save_pretrained

    _base_checkpoint(ckpt)
    model, _ = _peft_model(modules_to_save=["lm_head"])
    load_pretrained(model, ckpt)
    head = model.get_base_model().lm_head
    loaded = torch.equal(head.original_module.weight.full_tensor(), head.modules_to_save.default.weight.full_tensor())
    with torch.no_grad():
        head.modules_to_save.default.weight.to_local().mul_(2)  # as if trained
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.to_local().fill_(0.01)
        logits = model(input_ids=_prompt()).logits
    save_pretrained(model, os.path.join(out, "adapter"))
    save_pretrained(model, os.path.join(out, "merged"), merge_adapters=True)
    report = {"loaded": loaded}
    if dist.get_rank() == 0:
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt), os.path.join(out, "adapter"))
        with torch.no_grad():
            report["logits_equal"] = torch.equal(reloaded(input_ids=_prompt()).logits, logits)
        expected = reloaded.merge_and_unload().state_dict()
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged")).state_dict()
        report["merged_equal"] = merged.keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in merged.items())
    dist.barrier()
    return report


def test_modules_to_save_load_save_and_merge(tmp_path) -> None:
    pytest.importorskip("peft")
    results = run_on_ranks(WORLD, _modules_to_save, str(tmp_path / "base"), str(tmp_path / "out"), timeout=TIMEOUT_S)
    assert all(r["loaded"] for r in results), results
    assert results[0]["logits_equal"] and results[0]["merged_equal"], results[0]


def _unsupported_peft(out: str) -> dict:
    from fsdp_compose import save_pretrained

    model, _ = _peft_model(use_dora=True)
    errors = {}
    try:
        save_pretrained(model, os.path.join(out, "merged"), merge_adapters=True)
    except ValueError as error:
        errors["dora_merge"] = str(error)
    errors["nothing_written"] = not os.path.exists(os.path.join(out, "merged", "model.safetensors"))
    try:  # the base model holds the LoRA layers, but not the adapters' configuration
        save_pretrained(model.get_base_model(), os.path.join(out, "inner"))
    except ValueError as error:
        errors["not_peft_model"] = str(error)
    errors["inner_nothing_written"] = not os.path.exists(os.path.join(out, "inner"))
    plain = nn.Linear(4, 4)
    try:
        save_pretrained(plain, os.path.join(out, "plain"), merge_adapters=True)
    except ValueError as error:
        errors["no_adapters"] = str(error)
    return errors


def test_what_peft_saving_cannot_do_is_refused_by_name(tmp_path) -> None:
    pytest.importorskip("peft")
    for r in run_on_ranks(WORLD, _unsupported_peft, str(tmp_path), timeout=TIMEOUT_S):
        assert "q_proj" in r["dora_merge"] and "DoRA" in r["dora_merge"], r
        assert r["nothing_written"], r
        assert "holds no peft adapters" in r["no_adapters"], r
        assert "not a PeftModel" in r["not_peft_model"] and r["inner_nothing_written"], r


def _missing_initialized(ckpt: str, out: str) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from fsdp_compose import fully_shard, load_pretrained, save_pretrained

    lacking = ["model.norm.weight", "lm_head.weight"]
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(_config())
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in source.state_dict().items() if k not in lacking}, ckpt, metadata={"format": "pt"})
    dist.barrier()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(100 + dist.get_rank())  # the ranks' own streams: rank 0's is the one drawn from
    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_pretrained(model, ckpt, strict=False)
    rng_kept = torch.equal(torch.get_rng_state(), before)
    full = _full(model)
    # the model's own initialisation of those modules, from rank 0's state
    torch.manual_seed(100)
    reference = AutoModelForCausalLM.from_config(_config())
    torch.manual_seed(100)
    reference._init_weights(reference.model.norm)
    reference._init_weights(reference.lm_head)
    source_sd = source.state_dict()
    save_pretrained(model, out)
    report = {
        "missing": result.missing_keys,
        "warned": [str(w.message) for w in caught if "lacks" in str(w.message)],
        "as_init_weights": all(torch.equal(full[n], reference.state_dict()[n]) for n in lacking),
        "loaded": all(torch.equal(full[n], v) for n, v in source_sd.items() if n not in lacking),
        "rng_kept": rng_kept,
    }
    if dist.get_rank() == 0:
        with open(os.path.join(out, "config.json")) as f:
            report["architectures"] = json.load(f)["architectures"]
    dist.barrier()
    return report


def test_strict_false_initializes_missing_as_the_model_does_and_names_them(tmp_path) -> None:
    results = run_on_ranks(WORLD, _missing_initialized, str(tmp_path / "lacking.safetensors"), str(tmp_path / "out"), timeout=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["missing"] == ["model.norm.weight", "lm_head.weight"], r
        assert r["as_init_weights"] and r["loaded"] and r["rng_kept"], r
        assert bool(r["warned"]) == (rank == 0) and all("lm_head.weight" in w for w in r["warned"]), r
    assert results[0]["architectures"] == ["LlamaForCausalLM"], "config.json must name the model's own class"


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
