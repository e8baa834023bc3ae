"""Run by ``test_weights.py`` in a fresh interpreter (pytest collects only ``test_*.py``): the initial-weights check on
torch's threaded test backend."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase

from fsdp_compose import fully_shard


class TestThreadRanksShareOneGenerator(MultiThreadedTestCase):
    """torch's own FSDP2 tests run ranks as threads of one process, which share torch's random generator:
    the ranks of one test build different values, seeded or not, and no seed can make them alike. The check
    stays out of that backend, so those tests train as with torch's FSDP2 (``test_old_import_training``:
    an unseeded model, sharded, forward and backward); real ranks still fail (the tests above)."""

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_unseeded_thread_ranks_train(self) -> None:
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))  # draws from the shared generator
        mine = model[0].weight.detach().clone()
        others = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(others, mine)
        self.assertFalse(torch.equal(others[0], others[1]))  # the ranks really differ
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        model(torch.ones(2, 6)).sum().backward()  # no ValueError, as with torch's FSDP2
        self.assertTrue(all(isinstance(p.grad, DTensor) for p in model.parameters()))
