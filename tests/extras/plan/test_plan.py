"""plan(): the configuration it chooses for a budget, checked on real gloo runs; its table, its errors.

A real run's peak is measured by an independent live-storage tracker (tests/extras/observe/live_storage.py)
over every step, the first included; the losses are compared with one unsharded model trained on every
rank's batches. The search itself runs in plan's subprocess on fake tensors.
"""

from __future__ import annotations

import pickle
import re

import pytest
from expecttest import assert_expected_inline

from fsdp_compose import BudgetError, Plan
from fsdp_compose import plan as _plan
from fsdp_compose.extras.plan.config import CHILDREN, UNITS, Config
from fsdp_compose.extras.plan.planner import parse_budget
from fsdp_compose.extras.plan.plan_step import _BadBuild, call_build
from fsdp_compose.extras.plan.search import CHOSEN, COSTLIER, OVER, Candidate
from fsdp_compose.extras.plan.structure import Units, find_units
from tests.extras.observe.estimate_jobs import LM
from tests.extras.observe.live_storage import LiveStorage
from tests.extras.plan import plan_jobs
from tests.harness import hang_timeout, run_on_ranks


def plan(*args, **kwargs) -> Plan:
    """``fsdp_compose.plan`` with the suite's hang detector as its subprocess deadline (a loaded machine took
    over plan's own 600 s)."""
    return _plan(*args, timeout=hang_timeout(), **kwargs)


STEPS = 3


def _planned_run(chosen: Plan) -> dict:
    losses = []
    with LiveStorage() as live:  # entered before the job is built: its tensors count from their allocation
        model, make_optimizer, loss_fn = plan_jobs.gpt()
        chosen.apply(model)
        optimizer = make_optimizer(model.parameters())
        live.reset_peak()  # the steps' peak: not the unsharded model's before apply
        for _ in range(STEPS):
            loss = loss_fn()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {"peak": live.peak_bytes, "losses": losses}


def _check_real_run(chosen: Plan) -> list[int]:
    """The plan applied on real ranks: every rank's peak within the budget, the unsharded model's losses."""
    results = run_on_ranks(chosen.world_size, _planned_run, chosen)
    reference = plan_jobs.reference_losses(chosen.world_size, STEPS)
    for rank, result in enumerate(results):
        assert result["peak"] <= chosen.budget_bytes, (rank, result["peak"], chosen.budget_bytes, str(chosen))
        assert result["losses"] == pytest.approx(reference[rank], abs=1e-5, rel=0), rank
    return [result["peak"] for result in results]


def _budgets(world_size: int) -> dict[str, int]:
    """Generous: ten times the largest predicted peak; tight: 10% above the smallest; middling: halfway."""
    weighed = plan(plan_jobs.gpt, world_size, 1 << 40, like="gloo").candidates
    low, high = min(c.peak_bytes for c in weighed), max(c.peak_bytes for c in weighed)
    return {"generous": 10 * high, "middling": (low + high) // 2, "tight": int(low * 1.1)}


def test_a_middling_budget_on_two_real_ranks():
    chosen = plan(plan_jobs.gpt, 2, "4MiB", like="gloo")
    assert chosen.peak_bytes <= chosen.budget_bytes == 4 << 20
    assert chosen.config.checkpointed > 0, str(chosen)  # 4 MiB needs some recompute for this GPT
    _check_real_run(chosen)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_three_budgets_on_real_runs(world_size):
    measured = {}
    for name, budget in _budgets(world_size).items():
        chosen = plan(plan_jobs.gpt, world_size, budget, like="gloo")
        assert chosen.peak_bytes <= budget
        if name == "generous":
            assert chosen.config.checkpointed == 0 and chosen.config.grouping == UNITS, str(chosen)
        measured[name] = (budget, max(_check_real_run(chosen)), chosen.config)
    print(world_size, measured)


def _plan_on_this_rank() -> tuple:
    chosen = plan(plan_jobs.gpt, 2, "4MiB", like="gloo")
    return chosen.config, chosen.peak_bytes, str(chosen)


@pytest.mark.slow
def test_every_rank_of_a_running_job_gets_the_same_plan():
    first, second = run_on_ranks(2, _plan_on_this_rank)
    assert first == second


@pytest.mark.slow
def test_a_model_without_repeated_blocks():
    chosen = plan(plan_jobs.flat, 2, "1GiB", like="gloo")
    assert chosen.units == Units(("inp", "out"), False, "")
    assert {c.config.grouping for c in chosen.candidates} == {"root", UNITS}
    assert chosen.config.grouping == "root"  # fewest groups at the same cost


@pytest.mark.slow  # a subprocess more; the default run keeps one plan, checked on real ranks
def test_nothing_fits():
    with pytest.raises(BudgetError) as caught:
        plan(plan_jobs.flat, 2, "1KiB")
    message = str(caught.value)
    assert "no configuration fits 1.0 KiB per rank (1024 bytes) at world size 2" in message
    assert re.search(r"the smallest predicted peak is [\d.]+ KiB, with (one group|a group per unit)", message), message
    assert "Configurations weighed:" in message and message.count("over budget") == len(caught.value.args[0].splitlines()) - 5
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is BudgetError and str(again) == message


def test_budgets_as_bytes_or_strings():
    assert parse_budget(1234) == 1234
    assert parse_budget("12GiB") == 12 << 30
    assert parse_budget("500 MiB") == 500 << 20
    assert parse_budget("1.5GB") == 1_500_000_000
    for bad in ("12 parsecs", "-1GiB", "", 0):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)
    with pytest.raises(TypeError, match="budget"):
        parse_budget(12.0)


def test_units_are_the_repeated_blocks_else_the_roots_children():
    assert find_units(LM()) == Units(("blocks.0", "blocks.1", "blocks.2"), True, "Block")
    assert find_units(plan_jobs.Flat()) == Units(("inp", "out"), False, "")
    assert find_units(plan_jobs.Flat().inp) == Units((), False, "")


@pytest.mark.parametrize(
    "build, kind, says",
    [
        (plan_jobs.returns_two, TypeError, "returned tuple, not a 3-tuple"),
        (plan_jobs.returns_an_optimizer, TypeError, "second item is AdamW"),
        (plan_jobs.raises, RuntimeError, "build() raised KeyError: 'no such checkpoint'"),
    ],
)
def test_a_wrong_build_is_named_with_what_build_must_return(build, kind, says):
    with pytest.raises(_BadBuild) as caught:
        call_build(build)
    assert caught.value.kind == kind.__name__
    assert says in str(caught.value) and "build() must return (model, optimizer_fn, loss_fn)" in str(caught.value)


@pytest.mark.slow
def test_wrong_builds_raise_in_the_caller():
    with pytest.raises(ValueError, match=r"build\(\) sharded the model itself \(fully_shard on the root\)"):
        plan(plan_jobs.shards_itself, 2, "1GiB")
    with pytest.raises(RuntimeError, match="build\\(\\) raised KeyError"):
        plan(plan_jobs.raises, 2, "1GiB")


def test_the_table_names_every_configuration_and_why():
    units = Units(("blocks.0", "blocks.1"), True, "Block")

    def row(config, peak, moved, flops, verdict, measured=None):
        return Candidate(config, 5 if config.grouping == CHILDREN else 3, peak, moved, 0, flops,
                         moved / 50e9 + flops / 400e12, verdict, measured)

    candidates = [
        row(Config(UNITS, 0, 2), 9 << 20, 3 << 20, 0, OVER),
        row(Config(UNITS, 1, 0), 7 << 20, 4 << 20, 10**9, CHOSEN, 6 << 20),
        row(Config(CHILDREN, 2, 0), 5 << 20, 4 << 20, 2 * 10**9, COSTLIER),
    ]
    chosen = Plan(2, 8 << 20, units, candidates[1].config, 6 << 20, 7 << 20, candidates, fake_steps=4)
    assert_expected_inline(str(chosen), """\
plan for world size 2, budget 8.0 MiB per rank, on cpu; units: 2 repeated blocks of Block (blocks.0 .. blocks.1)
chosen: a group per unit, checkpointing 1 of 2 units, 0 of 2 kept unsharded after forward, no offload
peak 6.0 MiB per rank in its own fake step (predicted 7.0 MiB); 4 fake steps

grouping  groups  checkpointed  kept  offload  predicted peak  fake step  moved / step  recompute     cost      verdict
--------  ------  ------------  ----  -------  --------------  ---------  ------------  ---------  -------  -----------
units          3             0     2       no         9.0 MiB          -       3.0 MiB     0 FLOP  0.06 ms  over budget
units          3             1     0       no         7.0 MiB    6.0 MiB       4.0 MiB  1.0 GFLOP  0.09 ms       chosen
children       5             2     0       no         5.0 MiB          -       4.0 MiB  2.0 GFLOP  0.09 ms   costs more
checkpointed: the first units' forward recomputed in backward; kept: the last units with reshard_after_forward=False;
cost: bytes moved at 50 GB/s (CPU offload's copies at 25 GB/s) plus recompute at 400 TFLOP/s""")
    assert_expected_inline(chosen.table(rows=0), """\
grouping  groups  checkpointed  kept  offload  predicted peak  fake step  moved / step  recompute     cost  verdict
--------  ------  ------------  ----  -------  --------------  ---------  ------------  ---------  -------  -------
units          3             1     0       no         7.0 MiB    6.0 MiB       4.0 MiB  1.0 GFLOP  0.09 ms   chosen
(1 cheaper configurations left out, all over the budget)
(1 costlier configurations left out)""")
