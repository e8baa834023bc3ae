"""Train a tiny sharded model, run the flows a trainer adds around training, destroy the group, return.

Run by tests/workarounds/test_gloo_exit.py many times, spawned (no arguments) and under torchrun; every
run must exit 0. Before the TLS hiding in _runtime/collectives.py about one run in three aborted at exit.

Kept cheap because the test launches it 40 times: the spawning parent imports no torch (the
abort happens in the ranks' interpreters, which import it), and each rank does only what an
exit abort needs, once each: gloo collectives issued during ``backward()`` on DTensor
parameters and an optimizer step; then what trainers add (issue 24, item 2): an eval forward
under ``no_grad``, a full-state-dict gather, a DCP save and load, a ``generate``-like method
registered as a forward and called under ``no_grad``, and ``reset_iter_state()`` after an
exception raised mid-forward followed by one good step; then ``destroy_process_group()`` and
an ordinary interpreter exit.

``--torch`` runs the same flows on torch's FSDP2 (for comparison only; it has no
``reset_iter_state``, so that flow is skipped there).
"""

import multiprocessing
import os
import shutil
import socket
import sys
import tempfile

USE_TORCH_FSDP = "--torch" in sys.argv


def _model_class():
    import torch

    class TinyNet(torch.nn.Sequential):
        """Three layers; ``fail`` makes the next forward raise after the first (sharded) layer ran."""

        fail = False

        def forward(self, x):
            x = self[0](x)
            if self.fail:
                raise RuntimeError("injected failure mid-forward")
            return self[2](self[1](x))

        def generate(self, x, steps: int = 3):
            """A decoding-like loop: several forwards of the layers inside one call of the root."""
            for _ in range(steps):
                x = self[2](self[1](self[0](x))).repeat(1, 2)  # 4 -> 8 features: the next input
            return x

    return TinyNet


def train(checkpoint_dir: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    if USE_TORCH_FSDP:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    else:
        from fsdp_compose import fully_shard, register_fsdp_forward_method

    torch.manual_seed(0)
    model = _model_class()(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    with torch.no_grad():  # an eval forward
        model(torch.randn(4, 8))
    gather_full_state_dict(model)
    dcp.save(model.state_dict(), checkpoint_id=checkpoint_dir)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model.load_state_dict(state)
    with torch.no_grad():
        model.generate(torch.randn(2, 8))
    if not USE_TORCH_FSDP:
        model.fail = True
        try:
            step()
        except RuntimeError:
            model.reset_iter_state()
        else:
            raise AssertionError("the injected failure did not raise")
        model.fail = False
        step()


def gather_full_state_dict(model) -> dict:
    """The whole model's state dict on CPU: ours, or torch's equivalent for ``--torch``."""
    if USE_TORCH_FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from fsdp_compose import full_state_dict

    return full_state_dict(model)


def rank_main(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        dist.init_process_group("gloo")
    checkpoint_dir = [tempfile.mkdtemp(prefix="exit_cleanly_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(checkpoint_dir)  # one directory for all ranks (they share a host)
    try:
        train(checkpoint_dir[0])
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(checkpoint_dir[0], ignore_errors=True)
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
