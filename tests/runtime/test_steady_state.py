"""A step after the first pays nothing for what is checked once (issue 54, item 6): the weights verdict
(judged at the first forward), the optimizer check (an optimizer's first step: one attribute read after),
the double-backward guard and the end-of-backward callback (the backward's first hook only). Counted by
``sys.setprofile`` on 2 ranks: exact, whatever the machine's load."""

import collections
import os
import sys

import torch
import torch.distributed as dist

import fsdp_compose
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root

PACKAGE = os.path.dirname(fsdp_compose.__file__)


def _calls_per_step() -> list[dict]:
    torch.manual_seed(dist.get_rank())  # ranks build different values ...
    model = TinyLM()
    shard_blocks_then_root(model)
    torch.manual_seed(0)
    with torch.no_grad():  # ... then write every shard, as a load after fully_shard: judged at the first forward
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = local_slice(global_batch(0, 2), dist.get_rank(), 2)
    steps = []
    for _ in range(3):
        counts = collections.Counter()

        def profile(frame, event, arg, counts=counts):
            if event == "call":
                code = frame.f_code
                where = os.path.relpath(code.co_filename, PACKAGE).replace(os.sep, "/")
                counts[f"{where}:{code.co_name}"] += 1

        sys.setprofile(profile)
        try:
            lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        finally:
            sys.setprofile(None)
        steps.append(dict(counts))
    return steps


def test_once_only_checks_cost_nothing_after_the_first_step():
    for first, *later in run_on_ranks(2, _calls_per_step):
        assert first["_checks/weights.py:_raise_if_unwritten"] > 0  # the verdict, at the first forward
        assert first["_checks/optimizer.py:_check_first_step"] == 1 and first["_runtime/state.py:owner_of"] > 0
        for step in later:
            assert not [name for name in step if name.startswith("_checks/weights.py:")]
            assert step["_checks/optimizer.py:_check_first_step"] == 1  # returns at once: reads no parameter
            assert "_runtime/state.py:owner_of" not in step
            assert step["_runtime/hooks/backward.py:queue_end_of_backward"] == 1  # the backward's first hook only
            assert step["_runtime/hooks/backward.py:begin_graph_only"] == 1
