"""An HF ``Trainer`` run that shards, trains, ``save_model``s, evaluates and exits: run under torchrun.

Run by tests/workarounds/test_gloo_exit.py (``FSDP_COMPOSE_HF_EXIT_RUNS`` times); every run must exit 0
with no ``terminate called`` in its output. Users saw 2 aborts at exit in 9 runs of such a
script (issue 24, item 2). The model is sharded by fsdp_compose through accelerate's FSDP2 path
(``use_as_torch_fsdp()``, docs/trainers.md's CPU recipe); ``--torch`` uses torch's FSDP2 instead.
"""

import os
import shutil
import sys
import tempfile

USE_TORCH_FSDP = "--torch" in sys.argv


def main() -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

    from fsdp_compose_compat import use_as_torch_fsdp

    if USE_TORCH_FSDP:
        from torch.distributed.fsdp import FSDPModule
    else:
        from fsdp_compose import FSDPModule

    class CPUFSDPTrainer(Trainer):
        """docs/trainers.md: on a CPU-only machine accelerate picks MULTI_CPU (DDP); switch it to FSDP."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            PartialState().distributed_type = DistributedType.FSDP
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    output_dir = [tempfile.mkdtemp(prefix="exit_after_hf_") if rank == 0 else None]
    dist.broadcast_object_list(output_dir)  # one directory for all ranks (they share a host)
    patch = None if USE_TORCH_FSDP else use_as_torch_fsdp()
    try:
        args = TrainingArguments(
            output_dir=output_dir[0],
            use_cpu=True,
            per_device_train_batch_size=2,
            max_steps=3,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        )
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        model = AutoModelForCausalLM.from_config(config)
        dataset = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (12, 8))]
        trainer = CPUFSDPTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:4])
        trainer.train()
        assert isinstance(trainer.model.transformer.h[0], FSDPModule), type(trainer.model.transformer.h[0]).__mro__
        trainer.save_model(os.path.join(output_dir[0], "final"))  # every rank gathers; rank 0 writes
        trainer.evaluate()  # eval forwards under no_grad, and accelerate's gathers of the losses
        with torch.no_grad():
            trainer.model.eval()(input_ids=dataset[0]["input_ids"][None])
        dist.barrier()
    finally:
        if patch is not None:
            patch.undo()
        if rank == 0:
            shutil.rmtree(output_dir[0], ignore_errors=True)
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
