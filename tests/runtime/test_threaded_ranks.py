"""Ranks run as threads of one process (torch's threaded process group) train like gloo ranks.

PyTorch's own FSDP2 tests run CPU cases with ``FSDPTestMultiThread``: every rank is a thread
and the tests of one file share a process, with world sizes changing between test classes.
Group ids used by the order check must still agree across ranks there (_runtime/uids.py): a
process-wide counter gave rank 1 the ids after rank 0's and every forward raised a false
``ExecutionOrderError``. The world-size-1 class runs first on purpose: it advances rank 0's
count only, as a world-size-1 test class before a world-size-2 one does in torch's files.
Meshes and subgroups must be made per rank too (mesh.py): a process-wide cache handed every
thread the first rank's default mesh and ``reshard_after_forward=<int>`` subgroup, and four
ranks then waited forever in a two-rank collective. A watchdog turns such a hang into a failure.
"""

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

from fsdp_compose import fully_shard
from tests.harness import hang_timeout


def _model() -> nn.Sequential:
    """The same weights on every rank; a private generator, since threads share torch's global RNG."""
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _shard(model: nn.Sequential, reshard_after_forward: bool | int | None = None) -> nn.Sequential:
    fully_shard(model[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model[2], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


HANG_LIMIT_S = hang_timeout()  # as tests/harness.py; a hang fails, a slow machine does not


def _abort_hung_ranks() -> None:
    """Fail the test: wake every rank thread blocked in a collective and report a timeout."""
    error = TimeoutError(f"thread ranks still running after {HANG_LIMIT_S:.0f} s: a collective hung")
    MultiThreadedTestCase.exception_queue.put((-1, (TimeoutError, error, None)))
    ProcessLocalGroup.exception_handle(error)  # sets the termination flag, wakes one waiter per collective
    for collective in list(ProcessLocalGroup._cur_coll_on_pgs.values()):
        for condition in (collective._start_cond, collective._done_cond):
            with condition:
                condition.notify_all()  # several ranks may wait on one (wrong) collective


class _ThreadedRanks(MultiThreadedTestCase):
    def setUp(self) -> None:
        super().setUp()
        # threaded collectives wait without a timeout; torch's own limit is 300 s per rank
        self._watchdog = threading.Timer(HANG_LIMIT_S, _abort_hung_ranks)
        self._watchdog.daemon = True
        self._watchdog.start()
        self._spawn_threads()

    def tearDown(self) -> None:
        self._watchdog.cancel()
        super().tearDown()

    def train_against_reference(self, steps: int = 3, reshard_after_forward: bool | int | None = None) -> None:
        """Sharded training on this rank's share of the batch matches unsharded training on all of it."""
        reference, model = _model(), _shard(_model(), reshard_after_forward)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        world, rank = dist.get_world_size(), dist.get_rank()
        for step in range(steps):
            self.assertEqual(model[0].weight.device_mesh.get_coordinate(), (rank,))
            batch = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(100 + step))
            ref_loss = reference(batch).square().mean()
            ref_loss.backward()
            local = batch.chunk(world)[rank]
            loss = model(local).square().mean()
            loss.backward()
            losses = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(losses, loss.detach())
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), atol=1e-5, rtol=0)
            for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), ref.grad, atol=1e-5, rtol=0, msg=name)
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
        for p, ref in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor(), ref.detach(), atol=1e-5, rtol=0)


class TestOneThreadedRank(_ThreadedRanks):
    @property
    def world_size(self) -> int:
        return 1

    def test_trains_like_reference(self) -> None:
        self.train_against_reference()


class TestTwoThreadedRanks(_ThreadedRanks):
    @property
    def world_size(self) -> int:
        return 2

    def test_trains_like_reference(self) -> None:
        self.train_against_reference()


class TestFourThreadedRanks(_ThreadedRanks):
    @property
    def world_size(self) -> int:
        return 4

    def test_reshard_to_two_ranks_trains_like_reference(self) -> None:
        """reshard_after_forward=2: backward re-gathers within this rank's own pair of ranks.

        Twice: the second model reuses the subgroups the first one made on each rank.
        """
        for _ in range(2):
            self.train_against_reference(steps=2, reshard_after_forward=2)
