"""A Lightning ``Trainer`` on ``ModelParallelStrategy`` that shards with fsdp_compose, then exits normally.

Run by tests/workarounds/test_gloo_exit.py (``FSDP_COMPOSE_LIGHTNING_EXIT_RUNS`` times); every run must exit
0, print one ``exit_after_lightning rank R: done`` line per rank, and no ``terminate called``.
Users saw that abort at exit in about 1 of 20 runs of such a script (issue 24, item 2).

The users' flow, as in docs/trainers.md: 2 CPU ranks on gloo, ``fully_shard`` in
``configure_model`` over ``self.device_mesh["data_parallel"]``, three training steps, a
validation pass (Lightning runs it under ``no_grad`` on gloo) that logs with ``sync_dist``, a
sharded checkpoint (``trainer.save_checkpoint``: DCP, each rank its shards), and a plain return:
no ``destroy_process_group``, since Lightning leaves a gloo group alive until the interpreter exits.

``python exit_after_lightning.py`` lets Lightning start rank 1 itself (``devices=2`` re-runs this
script in a subprocess); under torchrun Lightning uses the ranks it is given. Lightning's own
launcher never waits for rank 1, so nobody sees rank 1's exit code; ``--reap`` runs the script
below a parent that adopts orphaned descendants (``PR_SET_CHILD_SUBREAPER``) and exits with the
worst code of rank 0 and every process Lightning started, without changing when either rank
exits. ``--torch`` shards with torch's FSDP2 instead (the comparison).
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile

USE_TORCH_FSDP = "--torch" in sys.argv
STEPS, PER_RANK, WORLD = 3, 2, 2


def main() -> int:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    if USE_TORCH_FSDP:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    else:
        from fsdp_compose import FSDPModule, fully_shard

    class LitNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            self.val_losses: list[float] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.model[0], mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def loss(self, batch: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.model(batch[:, :8]), batch[:, 8:])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            assert not torch.is_grad_enabled()
            loss = self.loss(batch)
            self.val_losses.append(loss.item())
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)  # every rank builds the same model and the same data
    data = torch.randn(WORLD * PER_RANK * STEPS, 12)
    lit = LitNet()
    root_dir = tempfile.mkdtemp(prefix="exit_after_lightning_")  # per process: only rank 0's path is used
    try:
        trainer = pl.Trainer(
            strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
            accelerator="cpu",
            devices=WORLD,
            max_steps=STEPS,
            limit_val_batches=2,
            default_root_dir=root_dir,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(data, batch_size=PER_RANK)
        trainer.fit(lit, loader, loader)
        assert isinstance(lit.model[0], FSDPModule), type(lit.model[0]).__mro__
        checkpoint = os.path.join(trainer.strategy.broadcast(root_dir), "final.ckpt")
        trainer.save_checkpoint(checkpoint)  # a directory: each rank's DCP shards, rank 0's metadata
        trainer.strategy.barrier()
        saved = sorted(os.listdir(checkpoint))
        trainer.strategy.barrier()  # rank 0 deletes the checkpoint next
        val_loss = trainer.callback_metrics["val_loss"].item()
    finally:
        shutil.rmtree(root_dir, ignore_errors=True)
    rank = trainer.global_rank
    print(
        f"exit_after_lightning rank {rank}: done, {len(lit.val_losses)} validation batches,"
        f" val_loss {val_loss:.4f}, checkpoint {saved}",
        flush=True,
    )
    return 0


def run_and_reap(argv: list[str]) -> int:
    """Run ``argv``, adopt the processes it leaves behind, wait for all; 0 or the first failure as 128 + signal."""
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    subprocess.Popen(argv)  # waited for below, with everything it started
    worst = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # no child left
            return worst
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            name = signal.Signals(-code).name if code < 0 else str(code)
            print(f"exit_after_lightning: process {pid} exited with {name}", file=sys.stderr, flush=True)
            worst = worst or (128 - code if code < 0 else code)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "--reap" in sys.argv:
        raise SystemExit(run_and_reap([sys.executable, __file__, *(a for a in sys.argv[1:] if a != "--reap")]))
    raise SystemExit(main())
