"""Issue 58, item 1: ``estimate()`` is never low. Its per-rank peak is at or above a real run's peak of live
tensor storage on every rank, and within 5% of it but for the buffers whose life gloo's threads decide
(``_check``); ``explain()``'s figure (sharded state and groups in flight, without activations) is within
[1.00, 1.05] of the same fake step's largest non-activation memory.

The real run: 3 AdamW steps of each job (``never_low_jobs.py``) on gloo ranks, its peak counted by
``live_storage.py`` (every storage c10's CPU allocator reports, on every thread: gloo's own copies included),
which ``test_live_storage.py`` checks against sizes computed by hand. The estimate: ``estimate(like="gloo")``
for each rank, in one subprocess per world size. ``test_ratio_table`` prints every ratio (``pytest -s``).
"""

from __future__ import annotations

import gc
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsdp_compose.extras.observe.estimate import estimate_many
from tests.extras.observe.live_storage import LiveStorage
from tests.extras.observe.never_low_jobs import JOBS, wide
from tests.harness import run_on_ranks

STEPS = 3
# the default run: the cases the issue named worst, at 3 ranks (one pool of ranks); every case at 2, 3 and 8 is slow
DEFAULT = [("no_gradient", 3), ("huge_and_tiny", 3), ("checkpointed", 3)]
SLOW = [(name, world) for world in (2, 3, 8) for name in JOBS if (name, world) not in DEFAULT]
# deselected by default where pyproject.toml declares the marker; without it, run only with FSDP_COMPOSE_SLOW=1
_DECLARED = '"slow:' in (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
slow = pytest.mark.slow if _DECLARED or os.environ.get("FSDP_COMPOSE_SLOW") == "1" else pytest.mark.skip(
    reason="a long run: FSDP_COMPOSE_SLOW=1 runs it (pyproject.toml declares no slow marker to deselect it)"
)
# (case, world) -> per rank: estimate / real, settled / real, explain / fake step without activations
RATIOS: dict[tuple[str, int], list[tuple[float, float, float]]] = {}


def _real_peak(name: str) -> int:
    """This rank's peak of live tensor storage over the job's first ``STEPS`` steps (its build excluded)."""
    gc.collect()
    with LiveStorage() as live:  # entered before the build, so that every free of the job's storages counts
        model, optimizer, loss_fn = JOBS[name]()
        live.reset_peak()
        for _ in range(STEPS):
            loss_fn().backward()
            optimizer.step()
            optimizer.zero_grad()
    return live.peak_bytes


@pytest.fixture(scope="module")
def estimates():
    """Every case's estimate, every rank, one subprocess per world size, started at once and collected when a
    test needs it (the real runs go on meanwhile)."""
    pool = ThreadPoolExecutor(1)
    futures = {}

    def get(name: str, world: int):
        if world not in futures:
            names = [n for n, w in DEFAULT + SLOW if w == world]
            jobs = [(JOBS[n], world, rank) for n in names for rank in range(world)]
            futures[world] = (names, pool.submit(estimate_many, jobs, like="gloo", timeout=1800))
        names, future = futures[world]
        at = names.index(name) * world
        return future.result()[at : at + world]

    yield get
    pool.shutdown(wait=False, cancel_futures=True)


def _check(estimates, name: str, world: int) -> None:
    """Never low: the estimate is at or above each rank's real peak. Tight: within 5% of it, once the buffers
    whose life gloo's threads decide (``settled_peak_bytes``: an all-gather's staging, counted to the
    transfer's latest end) are left out; a real step's peak lies between the two. And explain's figure is
    the fake step's largest non-activation memory."""
    reals = run_on_ranks(world, _real_peak, name, timeout=600)
    found = [(real, e) for real, e in zip(reals, estimates(name, world))]
    RATIOS[(name, world)] = [
        (e.peak_bytes / real, e.settled_peak_bytes / real, e.predicted_peak_bytes / e.peak_without_activations)
        for real, e in found
    ]
    for rank, (real, e) in enumerate(found):
        where = (name, world, rank, f"estimate {e.peak_bytes}, settled {e.settled_peak_bytes}, real {real}")
        assert e.peak_bytes >= real, where
        assert e.settled_peak_bytes <= 1.05 * real, where
        explained = e.predicted_peak_bytes / e.peak_without_activations
        assert 1.0 <= explained <= 1.05, (name, world, rank, e.predicted_peak_bytes, e.peak_without_activations)


@pytest.mark.parametrize("name, world", DEFAULT)
def test_estimate_is_never_low(estimates, name, world):
    _check(estimates, name, world)


@slow
@pytest.mark.parametrize("name, world", SLOW)
def test_estimate_is_never_low_everywhere(estimates, name, world):
    _check(estimates, name, world)


@slow
def test_at_64_and_512_ranks_the_shards_shrink_the_peak():
    """No ground truth there: the estimate runs, and the per-rank figure falls with the shards."""
    at64, at512 = estimate_many([(wide, 64, 0), (wide, 512, 0)], like="nccl", timeout=1800)
    sharded = [e.at_peak.get("parameters", 0) + e.at_peak.get("optimizer state", 0) for e in (at64, at512)]
    assert at512.peak_bytes < at64.peak_bytes, (at64.summary(), at512.summary())
    assert sharded[1] <= sharded[0] / 8 * 1.1, sharded


def test_ratio_table(capsys):
    """The ratios this run measured, per case and world size: min-max over the ranks."""
    if not RATIOS:
        pytest.skip("no case ran")
    rows = [f"{'case':14s} {'ranks':>5s} {'estimate/real':>15s} {'settled/real':>15s} {'explain/fake':>15s}"]
    for (name, world), found in sorted(RATIOS.items(), key=lambda item: (item[0][1], item[0][0])):
        spans = [f"{min(column):7.4f}-{max(column):.4f}" for column in zip(*found)]
        rows.append(f"{name:14s} {world:5d} " + " ".join(spans))
    with capsys.disabled():
        print("\n" + "\n".join(rows))
