"""estimate(): the fake step's per-rank peak and traffic, checked against real gloo runs of the same step.

The same build functions (tests/extras/observe/estimate_jobs.py) run on real gloo ranks, where c10's CPU
allocator's own reports (``live_storage.py``) measure a warm-up step and a steady one, and in estimate's
fake subprocess, once per rank (``like="gloo"``: gloo's own copies and staging buffers counted). All estimates
share one subprocess to save start-ups. ``test_never_low.py`` checks every configuration issue 58 names.
"""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest

from fsdp_compose import estimate
from fsdp_compose.extras.observe.estimate import CATEGORIES, estimate_many
from fsdp_compose.extras.observe.fake_step import traffic
from tests.extras.observe.live_storage import LiveStorage
from tests.harness import hang_timeout, run_on_ranks
from tests.extras.observe.estimate_jobs import JOBS, LM, fake_built, fp32

ALL_CASES = [(name, world) for name in JOBS for world in (2, 3)]
DEFAULT_CASES = [("fp32", 2), ("bf16_mixed", 3)]  # the rest run with the slow tests
CASES = [case if case in DEFAULT_CASES else pytest.param(*case, marks=pytest.mark.slow) for case in ALL_CASES]


def _real_step(name: str) -> dict:
    gc.collect()
    with LiveStorage() as live:  # entered before the job is built, so that every free of its storages counts
        model, optimizer, loss_fn = JOBS[name]()
        live.reset_peak()
        loss_fn().backward()  # warm-up: records the order, creates the optimizer state
        optimizer.step()
        optimizer.zero_grad()
        before = traffic(model)
        loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad()
        after = traffic(model)
    return {"peak": live.peak_bytes, "traffic": {k: [a - b for a, b in zip(after[k], before[k])] for k in after}}


@pytest.fixture(scope="module")
def estimates():
    """The default cases (rank 0 and last) estimated in one subprocess, started at once and collected when a
    test needs them, so it runs while the real gloo steps run; the slow cases in another, started when the
    first of them asks (``estimates(slow=True)``)."""

    def jobs_of(cases: list) -> list:
        return [(JOBS[name], world, rank) for name, world in cases for rank in (0, world - 1)]

    batches = {
        False: jobs_of(DEFAULT_CASES) + [(fp32, 2, 0, "nccl"), (fake_built, 2, 0)],
        True: jobs_of([case for case in ALL_CASES if case not in DEFAULT_CASES]),
    }
    with ThreadPoolExecutor(1) as pool:
        futures = {}

        def start(slow: bool) -> None:
            if slow not in futures:
                futures[slow] = pool.submit(estimate_many, batches[slow], like="gloo", timeout=hang_timeout())

        def get(slow: bool = False) -> dict:
            start(slow)
            done = futures[slow].result()
            return {(e.world_size, e.rank, build.__name__, e.like): e for (build, *_), e in zip(batches[slow], done)}

        start(False)
        yield get
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("name, world", CASES)
def test_estimated_peak_and_traffic_match_a_real_run(estimates, name, world):
    reals = run_on_ranks(world, _real_step, name)
    for rank in (0, world - 1):  # every rank but the last holds the same shards as rank 0
        real, e = reals[rank], estimates(slow=(name, world) not in DEFAULT_CASES)[(world, rank, name, "gloo")]
        assert e.collectives == real["traffic"], (rank, e.collectives, real["traffic"])
        # never low; within 5% but for gloo's all-gather buffers, whose life its threads decide (test_never_low)
        where = (name, world, rank, e.peak_bytes, e.settled_peak_bytes, real["peak"])
        assert e.settled_peak_bytes <= 1.05 * real["peak"] <= 1.05 * e.peak_bytes, where
        assert sum(e.at_peak.values()) == e.peak_bytes
        assert set(e.at_peak) <= {key for key, _ in CATEGORIES}


def test_a_model_built_under_fake_tensor_mode_estimates_like_a_real_one(estimates):
    """Built in a ``FakeTensorMode`` and sharded outside it, as torchtitan's estimator does: its
    parameters are FakeTensors, and the estimate is the real model's to the byte."""
    fake, real = estimates()[(2, 0, "fake_built", "gloo")], estimates()[(2, 0, "fp32", "gloo")]
    assert (fake.peak_bytes, fake.at_peak, fake.collectives) == (real.peak_bytes, real.at_peak, real.collectives)


def test_categories_are_the_tensors_they_name(estimates):
    """Sharded parameters and optimizer state at the peak are exactly this rank's shards and AdamW's state."""
    e = estimates()[(2, 0, "fp32", "gloo")]
    shard_bytes = [4 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in LM().parameters()]
    assert e.at_peak["parameters"] == sum(shard_bytes)
    assert e.at_peak["optimizer state"] == 2 * sum(shard_bytes) + 4 * len(shard_bytes)  # exp_avg, exp_avg_sq, step
    for category in ("unsharded parameters", "collective buffers", "unsharded gradients", "activations"):
        assert e.at_peak[category] > 0, (category, e.at_peak)
    assert e.phase_peaks["backward"] == e.peak_bytes and e.peak_phase == "backward"


def test_like_either_backend_agrees_with_explain(estimates):
    """``explain``'s replay counts what the fake step counts, like NCCL (``like="nccl"``, the default: each
    reduce-scatter's input held until its wait) and like gloo (its copies and staging buffers):
    the step's largest non-activation memory is explain's prediction."""
    e, gloo = estimates()[(2, 0, "fp32", "nccl")], estimates()[(2, 0, "fp32", "gloo")]
    for each in (e, gloo):
        assert 1.0 <= each.predicted_peak_bytes / each.peak_without_activations <= 1.05, (
            each.like,
            each.predicted_peak_bytes,
            each.peak_without_activations,
        )
    assert gloo.peak_without_activations > e.peak_without_activations  # gloo's copies
    text = str(e)
    for line in (
        "like nccl (reduce-scatter inputs held until their wait)",
        "activations and temporaries",
        "explain() predicts",
        "blocks.1",
    ):
        assert line in text, (line, text)


def test_a_subprocess_past_its_timeout_is_killed():
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        estimate(fp32, world_size=2, timeout=1)
