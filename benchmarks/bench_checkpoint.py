"""Save + load time of the benchmark GPT (~34M parameters, AdamW state) on 2 gloo ranks.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--dir /tmp/bench_ckpt]

Each round saves the model and its optimizer with ``save_checkpoint`` and loads them back with
``load_checkpoint`` (checksums verified, every file read through the checks); the medians of
wall time and of rank 0's CPU time (all its threads: steadier on a shared machine) are printed. Issue 48 bounds what the file-layer checks may add to a save + load: 5%.
"""

from __future__ import annotations

import argparse
import os
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


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    from fsdp_compose import fully_shard, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = shard(GPT(CONFIG), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    model(ids).float().mean().backward()
    optimizer.step()
    path = os.path.join(args.dir, "ckpt")
    times: dict[str, list[float]] = {"save": [], "load": [], "save cpu": [], "load cpu": []}
    for _ in range(args.rounds):
        for what, run in (
            ("save", lambda: save_checkpoint(path, model, optimizer, step=1, extra={"epoch": 1})),
            ("load", lambda: load_checkpoint(path, model, optimizer)),
        ):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            run()
            times[f"{what} cpu"].append(time.process_time() - cpu_start)
            dist.barrier()
            times[what].append(time.perf_counter() - start)
    if rank == 0:
        t = {what: statistics.median(values) for what, values in times.items()}
        print(
            f"wall: save {t['save']:.3f}s  load {t['load']:.3f}s  save+load {t['save'] + t['load']:.3f}s; "
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
