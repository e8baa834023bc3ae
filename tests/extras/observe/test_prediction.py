"""explain()'s predicted peak and bytes per step, checked against a live storage tracker and CommStats."""

import pytest
import torch

from fsdp_compose import explain
from fsdp_compose.extras.observe.storage import StorageTracker
from tests.harness import run_on_ranks
from tests.extras.observe.configs import build, counted_bytes


def _measure(config):
    model, loss_of = build(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):  # the first records the order; the second is a steady-state step
        loss_of(step).backward()
        opt.step()
        opt.zero_grad()
    predicted = explain(model, opt).totals
    tracker = StorageTracker()
    tracker.track_training_state(model, opt)
    start = counted_bytes(model)
    with tracker:
        tracker.reset_peak()
        loss_of(2).backward()
    return {
        "at": predicted.peak_at,
        "predicted_peak": predicted.predicted_peak_bytes,
        "measured_peak": tracker.peak,
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
