"""explain()'s predicted peak and bytes per step, checked against c10's CPU allocator's count of a real gloo step
(``live_storage.py``) and CommStats. The sequences are short, so parameters, gradients and collectives
are most of the memory explain predicts; ``test_never_low.py`` checks it against the fake step's own split."""

import gc

import pytest
import torch

from fsdp_compose import explain
from tests.extras.observe.live_storage import LiveStorage
from tests.extras.observe.configs import build, counted_bytes
from tests.harness import run_on_ranks


def _measure(config):
    gc.collect()
    with LiveStorage() as live:  # entered before the build, so that every free of the job's storages counts
        model, loss_of = build(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):  # the first records the order; the second is a steady-state step
            loss_of(step).backward()
            opt.step()
            opt.zero_grad()
        predicted = explain(model, opt).totals
        start = counted_bytes(model)
        live.reset_peak()
        loss_of(2).backward()
    return {
        "at": predicted.peak_at,
        "predicted_peak": predicted.predicted_peak_bytes,
        "measured_peak": live.peak_bytes,
        "predicted_bytes": predicted.bytes_per_step,
        "counted_bytes": counted_bytes(model) - start,
    }


CASES = [(c, ws) for c in ("gpt", "gpt_tied_mixed_precision", "gpt_offload") for ws in (2, 3)]
CASES += [pytest.param("gpt_hsdp", 4, marks=pytest.mark.slow), ("gpt_quantized", 2)]


@pytest.mark.parametrize("config, world_size", CASES)
def test_predicted_peak_and_bytes_match_measurement(config, world_size):
    for rank, r in enumerate(run_on_ranks(world_size, _measure, config)):
        assert r["predicted_bytes"] == r["counted_bytes"], (rank, r)
        error = r["predicted_peak"] / r["measured_peak"] - 1
        assert abs(error) <= 0.10, (rank, f"{error:+.1%}", r)
