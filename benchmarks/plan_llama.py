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
import sys
import time

import torch

from benchmarks.estimate_llama import LLAMA3_8B, LLAMA3_70B, children_cpu, unsharded_job
from fsdp_compose import MixedPrecisionPolicy, plan

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LLAMA3_70B_PLANNED = dataclasses.replace(LLAMA3_70B, checkpointed=False)  # plan chooses what to checkpoint


def llama3_8b():
    return unsharded_job(LLAMA3_8B)


def llama3_70b():
    return unsharded_job(LLAMA3_70B_PLANNED)


def main(argv: list[str]) -> None:
    name, world, budget = (argv + ["8b", "64", "16GiB"][len(argv):])[:3]
    build = {"8b": llama3_8b, "70b": llama3_70b}[name]
    began, cpu = time.perf_counter(), children_cpu()
    chosen = plan(build, world_size=int(world), budget=budget, mp_policy=MP, device="cuda", timeout=3600)
    print(
        f"=== Llama 3 {name.upper()} at world size {world}, budget {budget}: planned in "
        f"{time.perf_counter() - began:.1f} s ({children_cpu() - cpu:.1f} s of CPU in the subprocess; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(chosen.summary())
    print()
    print(chosen.table(rows=4))  # print(chosen) shows all the configurations weighed


if __name__ == "__main__":
    main(sys.argv[1:])
