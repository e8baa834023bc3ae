"""How should Llama 3 8B be sharded to fit 16 GiB per GPU on 64 GPUs? ``fsdp_compose.plan`` answers on this CPU machine.

The Llama-3-shaped model of ``benchmarks/estimate_llama.py`` (grouped-query attention, rotary
embeddings, SwiGLU, 2048 tokens per rank, AdamW), built on the meta device and **not** sharded:
``plan`` weighs groups, activation checkpointing, ``reshard_after_forward`` and CPU offload (for a
CUDA device) with fp32 parameters gathered in bf16, and measures the chosen one. Prints the plan
with the configurations around the chosen one, its wall time and the subprocess's CPU time:

    python -m benchmarks.plan_llama                   # Llama 3 8B, 64 ranks, 16 GiB
    python -m benchmarks.plan_llama 70b 512 60GiB     # another shape, world size and budget
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.estimate_llama import LLAMA3_8B, LLAMA3_70B, Llama, LlamaConfig
from fsdp_compose import MixedPrecisionPolicy, plan

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LLAMA3_70B_PLANNED = dataclasses.replace(LLAMA3_70B, checkpointed=False)  # plan chooses what to checkpoint


def unsharded_job(cfg: LlamaConfig):
    """What plan needs: the model on meta, unsharded, a function making the optimizer, the loss of a batch."""
    with torch.device("meta"):
        model = Llama(cfg)

    def loss_fn() -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    return model, lambda params: torch.optim.AdamW(params, lr=3e-4), loss_fn


def llama3_8b():
    return unsharded_job(LLAMA3_8B)


def llama3_70b():
    return unsharded_job(LLAMA3_70B_PLANNED)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
    name, world, budget = (argv + ["8b", "64", "16GiB"][len(argv):])[:3]
    build = {"8b": llama3_8b, "70b": llama3_70b}[name]
    began, cpu = time.perf_counter(), _children_cpu()
    chosen = plan(build, world_size=int(world), budget=budget, mp_policy=MP, device="cuda", timeout=3600)
    print(
        f"=== Llama 3 {name.upper()} at world size {world}, budget {budget}: planned in "
        f"{time.perf_counter() - began:.1f} s ({_children_cpu() - cpu:.1f} s of CPU in the subprocess; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(chosen.summary())
    print()
    print(chosen.table(rows=4))  # print(chosen) shows all the configurations weighed


if __name__ == "__main__":
    main(sys.argv[1:])
