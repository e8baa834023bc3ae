"""Train a tiny sharded model for two steps, destroy the process group and return.

Run by tests/test_clean_exit.py many times, spawned (no arguments) and under torchrun; every
run must exit 0. Before runtime/clean_tls.py about one run in three aborted at exit.

Kept cheap because the test launches it 40 times: the spawning parent imports no torch (the
abort happens in the ranks' interpreters, which import it), and each rank does only what the
abort needed: gloo collectives issued during ``backward()`` on DTensor parameters, an
optimizer step, ``destroy_process_group()``, then an ordinary interpreter exit.
"""

import multiprocessing
import os
import socket


def train() -> None:
    import torch

    from fsdp_compose import fully_shard

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
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        dist.init_process_group("gloo")
    train()
    dist.destroy_process_group()


def spawn(world_size: int = 2) -> int:
    """Start the ranks as spawned interpreters (what ``mp.spawn`` does); return the worst exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, world_size, port)) for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    return max(abs(process.exitcode) for process in ranks)  # -6 (SIGABRT) reads as 6


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RANK" in os.environ:
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0)
    else:
        raise SystemExit(spawn())
