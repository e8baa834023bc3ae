"""A group whose trainable parameters all get their gradients before its frozen ones are done with.

The root of a LoRA model with a trainable head (peft's ``modules_to_save``) holds a frozen embedding
and final norm and a trainable head; its inputs (token ids) need no gradient. Backward accumulates
the head's gradient first, then runs the norm's backward, which reads the norm's weight. The root
used to reshard at the head's gradient (every trainable parameter done, no input pending) and the
norm's backward read freed storage: a segfault. The outputs of the blocks called inside the root's
forward now hold the root's post-backward until backward has consumed them
([Note: nested outputs] in _runtime/hooks/forward.py).
"""

from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, freeze, shard_blocks_then_root, train_against_reference

FROZEN_AT_ROOT = {"embed.weight", "norm.weight", "norm.bias"}


def _frozen_root_but_head() -> TinyLM:
    return freeze(TinyLM(), FROZEN_AT_ROOT)


def _train() -> dict:
    return train_against_reference(_frozen_root_but_head, shard_blocks_then_root, steps=3)


def test_root_with_only_its_head_trainable_trains_at_parity():
    results = run_on_ranks(2, _train)
    assert_parity(results)
    assert results[0]["losses"][0] != results[0]["losses"][-1]  # it trained
