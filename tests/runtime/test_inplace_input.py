"""A sharded module may modify its input in place (e.g. ``ReLU(inplace=True)`` first).

The post-backward signal on a single plain input is a ``view_as`` with a hook on its node
(_runtime/hooks/backward.py); an in-place op on it replaces that node, so the group's
post-backward runs at the end of backward instead, with the same result. Before, the input
went through an ``autograd.Function`` whose output autograd refuses to modify in place
("Output 0 of PostBackwardSignal is a view and is being modified inplace"), as torch's FSDP2's
own post-backward Function does.
"""

import torch

from tests.harness import run_on_ranks
from tests.models import Block, TinyLM, assert_parity, shard_blocks_then_root, train_against_reference


class InplaceInputBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.mul_(0.5))


def _inplace_lm() -> TinyLM:
    model = TinyLM()
    model.blocks = torch.nn.ModuleList(InplaceInputBlock() for _ in model.blocks)
    return model


def _train():
    return train_against_reference(_inplace_lm, shard_blocks_then_root, steps=2)


def test_module_modifying_its_input_in_place_trains_at_parity():
    assert_parity(run_on_ranks(2, _train))
