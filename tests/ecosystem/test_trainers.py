"""Trainers that drive FSDP2 themselves: Lightning, the Hugging Face Trainer, and peft LoRA, on gloo ranks.

Each case trains the same model twice through the trainer, once with torch's FSDP2 and once with
ours, and checks that both runs agree bit for bit (every rank's losses, the final parameters),
and that ours matches an unsharded (or DDP) reference within 1e-5. Each case skips when its
library is not installed.

The trainers run inside the harness's ranks, whose process group already exists: Lightning and
accelerate both use an initialized group instead of creating one, once the torchrun variables
(``LOCAL_RANK``, ...) tell them that the processes were launched for them.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, max_param_diff

IMPLS = ["torch", "ours"]
STEPS, PER_RANK, WORLD = 3, 2, 2


def _implementation(impl: str) -> tuple[Callable, type]:
    """``fully_shard`` and ``FSDPModule`` of torch's FSDP2 or of ours."""
    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule, fully_shard
    else:
        from fsdp_compose import FSDPModule, fully_shard
    return fully_shard, FSDPModule


@contextlib.contextmanager
def torchrun_environment() -> Iterator[None]:
    """The variables torchrun sets, for this rank; trainers read them (and change them), so all are restored."""
    saved = dict(os.environ)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # read, never bound: the process group exists already
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, detached (results cross the process boundary)."""
    full = {}
    for name, param in model.named_parameters():
        param = param.detach()
        full[name] = param.full_tensor() if hasattr(param, "full_tensor") else param.clone()
    return full


def assert_bit_for_bit(torch_run: list[dict], our_run: list[dict]) -> None:
    """Every rank's losses and every final parameter identical (``torch.equal``)."""
    for rank, (theirs, ours) in enumerate(zip(torch_run, our_run)):
        assert ours["losses"] == theirs["losses"], (rank, ours["losses"], theirs["losses"])
        assert list(ours["params"]) == list(theirs["params"]), rank
        differ = [name for name in ours["params"] if not torch.equal(ours["params"][name], theirs["params"][name])]
        assert not differ, (rank, differ)


# --- Lightning: ModelParallelStrategy, fully_shard in configure_model --------------------------------------------


def _lightning_run(impl: str, root_dir: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    fully_shard, fsdp_module = _implementation(impl)

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM()
            self.losses: list[float] = []
            self.sharded: list[str] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.sharded = [name for name, m in self.model.named_modules() if isinstance(m, fsdp_module)]
            loss = lm_loss(self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    # each rank its slice of every global batch, in order (Lightning's DistributedSampler always shuffles training data)
    batches = [global_batch(step, WORLD, PER_RANK) for step in range(STEPS)]
    local_rows = torch.cat([local_slice(batch, dist.get_rank(), WORLD) for batch in batches])
    module = LitLM()
    reference = copy.deepcopy(module.model)
    with torchrun_environment():
        trainer = pl.Trainer(
            strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
            accelerator="cpu",
            devices=WORLD,
            num_nodes=1,
            max_steps=STEPS,
            default_root_dir=root_dir,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(local_rows, batch_size=PER_RANK))

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses = []
    for batch in batches:
        loss = lm_loss(reference, batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    mean_losses = torch.tensor(module.losses)
    dist.all_reduce(mean_losses)
    return {
        "losses": module.losses,
        "mean_losses": (mean_losses / WORLD).tolist(),
        "ref_losses": ref_losses,
        "params": full_parameters(module.model),
        "param_diff": max_param_diff(module.model, reference),
        "sharded": module.sharded,
    }


def test_lightning_model_parallel_strategy_trains_like_torch_fsdp2(tmp_path) -> None:
    pytest.importorskip("lightning")
    runs = {
        impl: run_on_ranks(WORLD, _lightning_run, impl, str(tmp_path / impl)) for impl in IMPLS
    }
    for r in runs["ours"]:
        assert r["sharded"] == ["", "blocks.0", "blocks.1", "blocks.2"], r["sharded"]
        assert len(r["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["mean_losses"], r["ref_losses"])) <= 1e-5, r
        assert r["param_diff"] <= 1e-5, r["param_diff"]
    assert_bit_for_bit(runs["torch"], runs["ours"])


# --- Hugging Face Trainer: fsdp_version 2 through use_as_torch_fsdp() ---------------------------------------------

HF_IMPLS = ["torch", "ours", "ddp"]  # ddp: the Trainer's own CPU default, the reference


def cpu_fsdp_trainer_class() -> type:
    """docs/trainers.md's ``CPUFSDPTrainer``: a ``Trainer`` that shards (and saves) with FSDP on a CPU-only machine.

    accelerate picks MULTI_CPU (DDP) there whatever the FSDP arguments say. Switching only the
    ``Accelerator``'s state is not enough: every later ``AcceleratorState()`` (the optimizer
    wrapper ``prepare`` builds makes one) copies ``PartialState``'s distributed type back, and
    ``save_model`` then takes the DDP path with sharded parameters. So both shared states are set.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer

    class CPUFSDPTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is not None:
                PartialState().distributed_type = DistributedType.FSDP
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    return CPUFSDPTrainer


def _hf_trainer_run(impl: str, output_dir: str) -> dict:
    import transformers
    from accelerate.state import AcceleratorState
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule  # before any patch: torch's own class
    from transformers import AutoModelForCausalLM, GPT2Config, TrainerCallback, TrainingArguments

    from fsdp_compose import FSDPModule as OurFSDPModule
    from fsdp_compose_compat import use_as_torch_fsdp

    transformers.logging.set_verbosity_error()

    class RecordingTrainer(cpu_fsdp_trainer_class()):
        losses: list[float]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    class RecordSharding(TrainerCallback):
        """Which implementation shards each decoder block, seen at every step of training."""

        def __init__(self) -> None:
            self.seen: set[tuple[str, ...]] = set()

        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            kinds = []
            for block in model.transformer.h:
                kinds.append(
                    "ours"
                    if isinstance(block, OurFSDPModule)
                    else "torch"
                    if isinstance(block, TorchFSDPModule)
                    else "none"
                )
            self.seen.add(tuple(kinds))

    fsdp_args = {}
    if impl != "ddp":
        fsdp_args = {
            "fsdp": "full_shard",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        }
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    gen = torch.Generator().manual_seed(0)
    dataset = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (STEPS * WORLD * PER_RANK, 8), generator=gen)
    ]
    recorder = RecordSharding()
    with torchrun_environment(), use_as_torch_fsdp() if impl == "ours" else contextlib.nullcontext():
        args = TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            per_device_train_batch_size=PER_RANK,
            max_steps=STEPS,
            learning_rate=1e-3,
            seed=0,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            **fsdp_args,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset, callbacks=[recorder])
        trainer.losses = []
        trainer.train()
        params = full_parameters(trainer.model)
        distributed_type = str(trainer.accelerator.distributed_type)  # after training: nothing switched it back
    AcceleratorState._reset_state(True)
    return {
        "losses": trainer.losses,
        "params": params,
        "sharding": sorted(recorder.seen),
        "distributed_type": distributed_type,
    }


def test_hf_trainer_fsdp2_through_use_as_torch_fsdp_trains_like_torch_fsdp2(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    runs = {
        impl: run_on_ranks(WORLD, _hf_trainer_run, impl, str(tmp_path / impl))
        for impl in HF_IMPLS
    }
    for impl in HF_IMPLS:
        kind = "none" if impl == "ddp" else impl
        assert all(r["sharding"] == [(kind, kind)] for r in runs[impl]), (impl, [r["sharding"] for r in runs[impl]])
        assert all(len(r["losses"]) == STEPS for r in runs[impl]), impl
        expected_type = "DistributedType.MULTI_CPU" if impl == "ddp" else "DistributedType.FSDP"
        types = [r["distributed_type"] for r in runs[impl]]
        assert types == [expected_type] * WORLD, (impl, types)
    assert_bit_for_bit(runs["torch"], runs["ours"])
    for ours, ddp in zip(runs["ours"], runs["ddp"]):
        assert max(abs(a - b) for a, b in zip(ours["losses"], ddp["losses"])) <= 1e-5, (ours["losses"], ddp["losses"])
        assert max((ours["params"][n] - ddp["params"][n]).abs().max().item() for n in ddp["params"]) <= 1e-5


def _hf_trainer_save_run(output_dir: str) -> dict:
    """Train sharded through the Trainer, ``save_model``, reload with ``from_pretrained`` on rank 0, compare logits."""
    import transformers
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, GPT2Config, TrainingArguments

    from fsdp_compose import FSDPModule
    from fsdp_compose_compat import use_as_torch_fsdp

    transformers.logging.set_verbosity_error()
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    gen = torch.Generator().manual_seed(0)
    dataset = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (STEPS * WORLD * PER_RANK, 8), generator=gen)
    ]
    prompt = torch.randint(0, 64, (2, 8), generator=gen)  # the same on every rank
    saved_dir = os.path.join(output_dir, "final")
    try:
        with torchrun_environment(), use_as_torch_fsdp():
            args = TrainingArguments(
                output_dir=output_dir,
                use_cpu=True,
                per_device_train_batch_size=PER_RANK,
                max_steps=STEPS,
                learning_rate=1e-2,
                seed=0,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                fsdp="full_shard",
                fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
            )
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            with torch.no_grad():
                untrained_logits = model(input_ids=prompt).logits
            trainer = cpu_fsdp_trainer_class()(model=model, args=args, train_dataset=dataset)
            trainer.train()
            trainer.save_model(saved_dir)  # every rank: accelerate gathers the full state dict, rank 0 writes it
            trained = trainer.model.eval()
            with torch.no_grad():
                logits = trained(input_ids=prompt).logits  # the sharded model: every rank runs the forward
            result = {
                "sharded": isinstance(trained.transformer.h[0], FSDPModule),
                "distributed_type": str(trainer.accelerator.distributed_type),
            }
            if dist.get_rank() == 0:
                reloaded = AutoModelForCausalLM.from_pretrained(saved_dir).eval()
                with torch.no_grad():
                    reloaded_logits = reloaded(input_ids=prompt).logits
                result["max_logit_diff"] = (reloaded_logits - logits).abs().max().item()
                result["trained"] = not torch.equal(logits, untrained_logits)
            dist.barrier()
    finally:
        AcceleratorState._reset_state(True)
    return result


def test_hf_trainer_save_model_reloads_with_from_pretrained(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    results = run_on_ranks(WORLD, _hf_trainer_save_run, str(tmp_path))
    assert all(r["sharded"] and r["distributed_type"] == "DistributedType.FSDP" for r in results), results
    assert results[0]["trained"] and results[0]["max_logit_diff"] <= 1e-6, results[0]
    assert (tmp_path / "final" / "model.safetensors").exists()


# --- peft LoRA: frozen base weights and trainable adapters in the same groups --------------------------------------


def _peft_lora_run(impl: str) -> dict:
    from peft import LoraConfig, get_peft_model

    fully_shard, _ = _implementation(impl)
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = TinyLM()
    # init_lora_weights=False: lora_B random too (peft's default zeros it), so every adapter gets gradients from step 0
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False))
    reference = copy.deepcopy(model)
    frozen_before = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    for block in model.base_model.model.blocks:
        fully_shard(block)
    fully_shard(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    losses, ref_losses = [], []
    for step in range(STEPS):
        batch = global_batch(step, WORLD, PER_RANK)
        loss = lm_loss(model, local_slice(batch, rank, WORLD))
        loss.backward()
        ref_loss = lm_loss(reference, batch)
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)
    params = full_parameters(model)
    base_unchanged = all(torch.equal(params[name], before) for name, before in frozen_before.items())
    return {
        "losses": losses,
        "mean_losses": (mean_losses / WORLD).tolist(),
        "ref_losses": ref_losses,
        "params": params,
        "param_diff": max_param_diff(model, reference),
        "trainable": trainable,
        "base_unchanged": base_unchanged,
        "frozen": len(frozen_before),
    }


def test_peft_lora_trains_like_torch_fsdp2() -> None:
    pytest.importorskip("peft")
    runs = {impl: run_on_ranks(WORLD, _peft_lora_run, impl) for impl in IMPLS}
    for r in runs["ours"]:
        assert len(r["trainable"]) == 12 and all(".lora_" in name for name in r["trainable"]), r["trainable"]
        assert r["frozen"] == len(list(TinyLM().parameters())) and r["base_unchanged"]  # every base weight, untouched
        assert max(abs(a - b) for a, b in zip(r["mean_losses"], r["ref_losses"])) <= 1e-5, r
        assert r["param_diff"] <= 1e-5, r["param_diff"]
    assert_bit_for_bit(runs["torch"], runs["ours"])


def _peft_adapter_save_run(out_dir: str) -> dict:
    """Train a LoRA adapter on a sharded model, save it from the gathered state dict, reload on an unsharded base."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from fsdp_compose import full_state_dict, fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = get_peft_model(TinyLM(), LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False))
    for block in model.base_model.model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        lm_loss(model, local_slice(global_batch(step, WORLD, PER_RANK), rank, WORLD)).backward()
        opt.step()
        opt.zero_grad()
    prompt = global_batch(STEPS, WORLD, PER_RANK)  # the same on every rank
    with torch.no_grad():
        logits = model(prompt)  # the sharded model: every rank runs the forward
    state_dict = full_state_dict(model)  # every rank; rank 0 gets every tensor, base and adapters
    result = {}
    if rank == 0:
        model.save_pretrained(out_dir, state_dict=state_dict)  # peft keeps the adapter's keys only
        torch.manual_seed(0)
        reloaded = PeftModel.from_pretrained(TinyLM(), out_dir)  # the same base weights, unsharded
        with torch.no_grad():
            result["max_logit_diff"] = (reloaded(prompt) - logits).abs().max().item()
            with reloaded.disable_adapter():
                result["base_logit_diff"] = (reloaded(prompt) - logits).abs().max().item()
        result["saved_keys"] = sorted(load_file(os.path.join(out_dir, "adapter_model.safetensors")))
    dist.barrier()
    return result


def test_peft_adapter_saved_from_sharded_model_reloads_on_unsharded_base(tmp_path) -> None:
    pytest.importorskip("peft")
    results = run_on_ranks(WORLD, _peft_adapter_save_run, str(tmp_path / "adapter"))
    saved = results[0]
    assert len(saved["saved_keys"]) == 12 and all(".lora_" in key for key in saved["saved_keys"]), saved["saved_keys"]
    assert saved["max_logit_diff"] <= 1e-6, saved
    assert saved["base_logit_diff"] > 1e-3, saved  # the adapter changes the output: it was trained and loaded
