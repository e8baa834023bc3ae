"""Train a small GPT sharded with fsdp_compose.

    python examples/train.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 4 examples/train.py  # or any launcher that sets RANK/WORLD_SIZE
    python examples/train.py --checkpoint-dir ckpt # save every --save-every steps; resume if present

Sharding is the ``fully_shard`` calls; code written for ``torch.distributed.fsdp.fully_shard``
runs with the import changed. ``--checkpoint-dir`` adds fsdp_compose's atomic checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, lm_loss, synthetic_batch  # noqa: E402

from fsdp_compose import checkpoint_exists, fully_shard, load_checkpoint, save_checkpoint  # noqa: E402


def train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    cfg = GPTConfig()
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.checkpoint_dir and checkpoint_exists(args.checkpoint_dir):  # the previous one counts too
        start, _ = load_checkpoint(args.checkpoint_dir, model, optimizer)  # any world size
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}", flush=True)
    for step in range(start, args.steps):
        loss = lm_loss(model, synthetic_batch(cfg, args.batch_size, step, rank))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0:
            print(f"step {step:3d}  loss {reported.item() / world_size:.4f}", flush=True)
        done = step + 1
        if args.checkpoint_dir and (done % args.save_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint_dir, model, optimizer, step=done)


def train_and_exit(args: argparse.Namespace) -> None:
    """Train, then tear the process group down; the process exits normally (status 0)."""
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    train_and_exit(args)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--checkpoint-dir", default=None, help="save here every --save-every steps; resume from it")
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun or another launcher
        dist.init_process_group("gloo")
        train_and_exit(args)
    else:
        mp.start_processes(run_rank, args=(args.nprocs, free_port(), args), nprocs=args.nprocs, start_method="spawn")


if __name__ == "__main__":
    main()
