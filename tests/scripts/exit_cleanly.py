"""Train a tiny sharded model for two steps, destroy the process group and return.

Run by tests/test_clean_exit.py many times, spawned (no arguments) and under torchrun; every
run must exit 0. Before runtime/clean_tls.py about one run in three aborted at exit.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compose import fully_shard


def train() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def rank_main(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    train()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "RANK" in os.environ:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        train()
        dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(rank_main, args=(2, port), nprocs=2, start_method="spawn")
