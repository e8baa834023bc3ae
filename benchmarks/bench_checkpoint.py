"""Save + load time of the benchmark GPT (~34M parameters, AdamW state) on 2 gloo ranks.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--dir /tmp/bench_ckpt]

Each round saves the model and its optimizer with ``save_checkpoint`` and loads them back with
``load_checkpoint`` (checksums verified, every file read through the checks), then does the same
for torch's FSDP2 the usual way: ``get_state_dict`` + ``dcp.save``, ``dcp.load`` + ``set_state_dict``
(the same model, seed and optimizer state; no checksums, no atomic rename). The medians of wall time
and of rank 0's CPU time (all its threads: steadier on a shared machine) are printed for both.
Issue 48 bounds what the file-layer checks may add to a save + load: 5%.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT  # noqa: E402

from benchmarks.bench_model import CONFIG, shard  # noqa: E402
from benchmarks.common import spawn_ranks  # noqa: E402


def build(fully_shard):
    torch.manual_seed(0)
    model = shard(GPT(CONFIG), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    model(ids).float().mean().backward()
    optimizer.step()
    return model, optimizer


def dcp_save(path: str, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(path: str, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model, optimizer = build(fully_shard)
    torch_model, torch_optimizer = build(torch_fully_shard)
    ours, theirs = os.path.join(args.dir, "ours"), os.path.join(args.dir, "dcp")
    ways = {  # each round writes a fresh directory, removed after its load (untimed)
        "ours": (
            lambda: save_checkpoint(ours, model, optimizer, step=1, extra={"epoch": 1}),
            lambda: load_checkpoint(ours, model, optimizer),
            ours,
        ),
        "torch FSDP2 + DCP": (
            lambda: dcp_save(theirs, torch_model, torch_optimizer),
            lambda: dcp_load(theirs, torch_model, torch_optimizer),
            theirs,
        ),
    }
    times = {way: {"save": [], "load": [], "save cpu": [], "load cpu": []} for way in ways}
    for round_ in range(args.rounds):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))  # load drift hits both alike
        for way in order:
            save, load, path = ways[way]
            for what, run in (("save", save), ("load", load)):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                run()
                times[way][f"{what} cpu"].append(time.process_time() - cpu_start)
                dist.barrier()
                times[way][what].append(time.perf_counter() - start)
            if rank == 0:
                shutil.rmtree(path)
            dist.barrier()
    if rank == 0:
        for way, figures in times.items():
            t = {what: statistics.median(values) for what, values in figures.items()}
            print(
                f"{way:18s} wall: save {t['save']:.3f}s  load {t['load']:.3f}s  save+load {t['save'] + t['load']:.3f}s; "
                f"rank 0 CPU: save {t['save cpu']:.3f}s  load {t['load cpu']:.3f}s  "
                f"save+load {t['save cpu'] + t['load cpu']:.3f}s  (medians of {args.rounds})"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        args.dir = args.dir or scratch
        spawn_ranks(rank_main, args)


if __name__ == "__main__":
    main()
