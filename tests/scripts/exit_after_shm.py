"""Train through ``fsdp_compose_shm.use_shm``, destroy the process group and return.

Run by tests/workarounds/test_gloo_exit.py; every run must exit 0. Without the grace period at exit
(``fsdp_compose_shm._let_gloo_threads_finish``) about one run in four aborted at exit
("terminate called without an active exception"). torch.multiprocessing.spawn, as in the runs
that showed it.
"""

import socket
import sys


def rank_main(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_compose import fully_shard
    from fsdp_compose_shm import use_shm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    use_shm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(rank_main, args=(free_port,), nprocs=2)
    sys.exit(0)
