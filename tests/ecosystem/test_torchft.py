"""Fault-tolerant HSDP with torchft 0.2.0 (fsdp_compose/extras/fault_tolerance.py, docs/fault-tolerance.md).

Two replica groups train examples/fault_tolerant.py's model. Most cases hold both groups in one job of the test
harness, against a lighthouse in this process: at 2 ranks one rank per group (the default run), at 4 ranks two
(ranks 0-1 and 2-3, slow), each group with its own store, manager and ``fully_shard`` mesh. The kill needs
processes that can die, so it runs the example itself. Results are compared bitwise with plain HSDP on the same
global batch, or with a replay of the steps the groups committed. Deadlines only catch hangs
(``hang_timeout``). Skipped without torchft.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.harness import hang_timeout, run_on_ranks

torchft = pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402

from fsdp_compose import FaultTolerance, FaultToleranceError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fault_tolerant.py"
_loaded = []


def _example():
    """examples/fault_tolerant.py as a module: its model, data and optimizer are the recipe's."""
    if not _loaded:
        spec = importlib.util.spec_from_file_location("fault_tolerant_example", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded.append(module)
    return _loaded[0]


class Lighthouse:
    """A torchft lighthouse in this process (what ``torchft_lighthouse`` runs)."""

    def __init__(self, min_replicas: int, heartbeat_timeout_ms: int = 5000) -> None:
        self.server = LighthouseServer(
            bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=20000, heartbeat_timeout_ms=heartbeat_timeout_ms
        )
        self.address = "http://localhost:" + self.server.address().rsplit(":", 1)[1]

    def __enter__(self) -> str:
        return self.address

    def __exit__(self, *exc) -> None:
        self.server.shutdown()


# ----- in the 4-rank job: two replica groups, or plain HSDP -----------------------------------------------
def _mesh():
    """Two replica groups of ``world / 2`` ranks: plain HSDP's mesh, and each group's ``fully_shard`` mesh."""
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


TIMEOUTS = dict(  # torchft's: a peer that died is seen at once (its sockets close); these only catch hangs
    timeout=timedelta(seconds=hang_timeout(60)),
    quorum_timeout=timedelta(seconds=hang_timeout(120)),
    connect_timeout=timedelta(seconds=hang_timeout(30)),
)


def _group_store(group: dist.ProcessGroup) -> tuple[dist.TCPStore | None, int]:
    """A TCPStore for one replica group, hosted by its rank 0 (as torchrun's would be)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if dist.get_rank(group) == 0 else None
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=dist.get_global_rank(group, 0), group=group)
    return store, port[0]


def _fault_tolerant(lighthouse: str, mesh, model, optimizer, **kwargs) -> FaultTolerance:
    group = mesh["shard"].get_group()
    store, port = _group_store(group)
    ft = FaultTolerance(
        model,
        optimizer,
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=hang_timeout(60))),
        group=group,
        replica_id=f"g{mesh['replicate'].get_local_rank()}",
        lighthouse=lighthouse,
        store_addr="127.0.0.1",
        store_port=port,
        **TIMEOUTS,
        **kwargs,
    )
    ft._test_store = store  # alive as long as the manager
    return ft


def _hsdp(steps: int) -> dict:
    ex = _example()
    model, optimizer = ex.build(mesh=_mesh())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = ex.loss_of(model, dist.get_rank(), step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "shards": ex.shards(model, optimizer)}


def _torchft_run(lighthouse: str, steps: int, read_state_dicts: bool) -> dict:
    """Both replica groups train ``steps`` steps through torchft; with ``read_state_dicts`` a thread of every rank
    takes state dicts (and serializes them, as torchft's transport does) the whole time."""
    ex = _example()
    mesh = _mesh()
    model, optimizer = ex.build(mesh=mesh["shard"])
    ft = _fault_tolerant(lighthouse, mesh, model, optimizer)
    in_step, stop, reads = threading.Event(), threading.Event(), [0, 0]

    def read() -> None:
        while not stop.is_set():
            during = in_step.is_set()
            torch.save(ft.state_dict(), __import__("io").BytesIO())
            reads[0] += 1
            reads[1] += during and in_step.is_set()

    reader = threading.Thread(target=read, daemon=True)
    if read_state_dicts:
        reader.start()
    losses, log = [], []
    try:
        while ft.manager.current_step() < steps:
            step = ft.manager.current_step()
            ft.optimizer.zero_grad()
            in_step.set()
            loss = ex.loss_of(model, dist.get_rank(), step)
            loss.backward()
            in_step.clear()
            ft.optimizer.step()
            losses.append(loss.item())
            log.append((step, ft.optimizer.committed, ft.manager.num_participants()))
    finally:
        stop.set()
        if read_state_dicts:
            reader.join()
        ft.shutdown()
    return {"losses": losses, "log": log, "shards": ex.shards(model, optimizer), "reads": reads}


def _healthy_and_hsdp(lighthouses: list[str], steps: int) -> dict:
    return {
        "hsdp": _hsdp(steps),
        "ft": _torchft_run(lighthouses[0], steps, read_state_dicts=False),
        "ft_reading": _torchft_run(lighthouses[1], steps, read_state_dicts=True),
    }


def _assert_same_shards(got: dict, want: dict, what: str) -> None:
    for name, tensor in want["params"].items():
        assert torch.equal(got["params"][name], tensor), f"{what}: parameter {name} differs"
    for i, (g, w) in enumerate(zip(got["optim"], want["optim"])):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), f"{what}: optimizer state {i} differs"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_healthy_run_and_state_dicts_from_a_thread_equal_plain_hsdp(world):
    """(a) 2 replica groups (of 1 or 2 ranks) through torchft equal HSDP on a (2, world / 2) mesh, bitwise: each
    rank's losses, shards and optimizer state. (c) The same run while a thread of every rank takes state dicts
    during the steps (forward and backward included) is bitwise the same: the state-dict functions read only
    the shards."""
    steps = 4
    with Lighthouse(2) as first, Lighthouse(2) as second:
        results = run_on_ranks(world, _healthy_and_hsdp, [first, second], steps)
    for rank, result in enumerate(results):
        want = result["hsdp"]
        for run in ("ft", "ft_reading"):
            got = result[run]
            assert got["log"] == [(s, True, 2) for s in range(steps)], (rank, run, got["log"])
            assert got["losses"] == want["losses"], (rank, run, got["losses"], want["losses"])
            _assert_same_shards(got["shards"], want["shards"], f"rank {rank}, {run}")
        reads, during = result["ft_reading"]["reads"]
        assert reads > 0 and during > 0, (rank, reads, during)


# ----- bad input: a clear error on every rank --------------------------------------------------------------
def _errors(lighthouse: str, unreachable: str) -> dict[str, str]:
    ex = _example()
    found = {}

    def attempt(name, make, step=False):
        model, optimizer = ex.build()
        try:
            ft = make(model, optimizer)
            if step:
                try:
                    ft.optimizer.zero_grad()
                    ex.loss_of(model, dist.get_rank(), 0).backward()
                    ft.optimizer.step()
                finally:
                    ft.shutdown()
            found[name] = "no error"
        except FaultToleranceError as error:
            found[name] = str(error)

    store, port = _group_store(dist.group.WORLD)
    common = dict(store_addr="127.0.0.1", store_port=port, **TIMEOUTS)
    pg = lambda: torchft.ProcessGroupGloo(timeout=timedelta(seconds=hang_timeout(60)))  # noqa: E731
    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    attempt("no lighthouse", lambda m, o: FaultTolerance(m, o, pg=pg(), **common))
    attempt("unreachable", lambda m, o: FaultTolerance(m, o, pg=pg(), lighthouse=unreachable, **common))
    attempt("not torchft's pg", lambda m, o: FaultTolerance(m, o, pg=dist.group.WORLD, lighthouse=lighthouse, **common))
    attempt("min_replica_size", lambda m, o: FaultTolerance(m, o, pg=pg(), min_replica_size=0, lighthouse=lighthouse, **common))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    attempt("no store", lambda m, o: FaultTolerance(m, o, pg=pg(), lighthouse=lighthouse))
    attempt("a block", lambda m, o: FaultTolerance(m.blocks[0], o, pg=pg(), lighthouse=lighthouse, **common))
    attempt("manager fails", lambda m, o: FaultTolerance(m, o, pg=pg(), lighthouse=lighthouse, bogus=1, **common))

    def block_only(model, _):
        block = model.blocks[0]
        return FaultTolerance(block, torch.optim.AdamW(block.parameters()), pg=pg(), lighthouse=lighthouse, **common)

    attempt("a block and its optimizer", block_only, step=True)

    def replaced(model, optimizer):
        ft = FaultTolerance(model, optimizer, pg=pg(), lighthouse=lighthouse, **common)
        model.load_state_dict(model.state_dict(), assign=True)  # new parameter objects, adopted by fully_shard
        return ft

    attempt("replaced after", replaced, step=True)
    del store
    return found


def test_misconfiguration_is_one_clear_error_on_every_rank():
    """torchft's lighthouse missing or unreachable, a process group that is not torchft's, a bad
    ``min_replica_size``, no store for the manager, ``torchft.Manager`` failing on rank 0 (the others would wait
    for its server), the hook asked for on a block instead of the root (caught at construction when the optimizer
    steps parameters outside it, else at the first step), parameters replaced after it was built: each rank
    raises the same ``FaultToleranceError``, and no rank waits on another."""
    # a short heartbeat time-out: each case's manager leaves, and the next quorum waits until it is seen gone
    with Lighthouse(1, heartbeat_timeout_ms=1000) as lighthouse:
        with __import__("socket").socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            unreachable = f"http://127.0.0.1:{s.getsockname()[1]}"
        results = run_on_ranks(2, _errors, lighthouse, unreachable)
    assert results[0] == results[1]  # the same message on both ranks
    found = results[0]
    assert "no torchft lighthouse address" in found["no lighthouse"], found
    assert f"the torchft lighthouse at {unreachable} does not answer" in found["unreachable"], found
    assert "pg must be a torchft process group" in found["not torchft's pg"], found
    assert "min_replica_size must be a positive int, got 0" in found["min_replica_size"], found
    assert "set MASTER_ADDR and MASTER_PORT" in found["no store"], found
    assert "torchft.Manager failed on rank 0: TypeError:" in found["manager fails"] and "bogus" in found["manager fails"], found
    assert "the optimizer steps 'inp.weight'" in found["a block"] and "Pass the root module" in found["a block"], found
    message = "the module passed, 'blocks.0' (Block), is not the root of its sharded model, '<root>' (Net) is"
    assert message in found["a block and its optimizer"], found
    assert "the model's sharded parameters were replaced after FaultTolerance was built" in found["replaced after"], found


def test_without_torchft_building_it_names_the_extra():
    """The names import without torchft (``fsdp_compose`` exports them); building a ``FaultTolerance`` says how
    to install the extra, before any collective."""
    code = (
        "import sys; sys.modules['torchft'] = None\n"
        "from fsdp_compose import FaultTolerance, FaultToleranceError\n"
        "FaultTolerance(None, None, pg=None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_timeout(), cwd=ROOT)
    assert done.returncode == 1
    assert "ImportError: FaultTolerance needs torchft 0.2.0 (the 'ft' extra): pip install torch==2.13.0 -e '.[ft]'" in done.stderr, done.stderr


# ----- replica groups holding different models -----------------------------------------------------------
def _build_variant(mesh, variant: str, group_id: int):
    ex = _example()
    model, optimizer = ex.build(mesh=mesh["shard"], width=ex.WIDTH + 8 if variant == "shapes" and group_id else ex.WIDTH)
    if variant == "weights" and group_id:
        with torch.no_grad():
            model.out.weight.to_local().add_(1.0)
    return model, optimizer


def _one_step(ft: FaultTolerance, model, step: int) -> None:
    ft.optimizer.zero_grad()
    _example().loss_of(model, dist.get_rank(), step).backward()
    ft.optimizer.step()


def _different_models(lighthouse: str, variant: str) -> str:
    mesh = _mesh()
    model, optimizer = _build_variant(mesh, variant, mesh["replicate"].get_local_rank())
    ft = _fault_tolerant(lighthouse, mesh, model, optimizer)
    try:
        _one_step(ft, model, 0)
        return "no error"
    except FaultToleranceError as error:
        return str(error)
    finally:
        ft.shutdown()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", ["shapes", "weights"])
def test_replica_groups_with_different_models_raise_on_every_rank(variant, world):
    """Group 1 builds a wider model, or starts from other weights: at the first step every rank of both groups
    raises, before any gradient crosses between the groups (a mismatched all-reduce could hang gloo)."""
    with Lighthouse(2) as lighthouse:
        messages = run_on_ranks(world, _different_models, lighthouse, variant)
    want = {
        "shapes": "the 2 replica groups training in this quorum hold different models (parameter names, shapes",
        "weights": "the 2 replica groups start from different weights (a rank's shards differ at step 0)",
    }[variant]
    assert all(want in m for m in messages), messages
    half = world // 2  # each group's ranks raise the same message
    assert len({m.split(" (rank")[0] for m in messages[:half]}) == 1 and len({m.split(" (rank")[0] for m in messages[half:]}) == 1


def _late_joiner(lighthouse: str, directory: str) -> dict:
    """Group 0 trains alone; group 1 joins at step >= 2 with a wider model: it raises, group 0 trains on."""
    mesh, marks = _mesh(), Path(directory)
    group_id = mesh["replicate"].get_local_rank()
    if group_id == 1:
        deadline = time.monotonic() + hang_timeout(120)
        while not (marks / "step2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    model, optimizer = _build_variant(mesh, "shapes", group_id)
    ft = _fault_tolerant(lighthouse, mesh, model, optimizer)
    try:
        if group_id == 1:
            try:
                _one_step(ft, model, 0)
                return {"error": "no error"}
            except FaultToleranceError as error:
                return {"error": str(error)}
            finally:
                (marks / f"joiner{dist.get_rank()}").touch()
        log, deadline = [], time.monotonic() + hang_timeout(240)
        joiners = dist.get_world_size() // 2
        while time.monotonic() < deadline and not (len(list(marks.glob("joiner*"))) == joiners and log[-1][1]):
            step = ft.manager.current_step()
            _one_step(ft, model, step)
            log.append((step, ft.optimizer.committed, ft.manager.num_participants()))
            if step == 2 and dist.get_rank() == 0:
                (marks / "step2").touch()
            time.sleep(0.05)
        return {"log": log}
    finally:
        ft.shutdown()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_replica_group_joining_with_a_different_model_raises_and_the_others_train_on(tmp_path, world):
    """A group joining late (it would recover from the others) with a model of other shapes: its ranks raise, at
    the quorum that admits it and before its gradients are averaged in; the training group throws that one step
    away and goes on alone."""
    with Lighthouse(1, heartbeat_timeout_ms=1000) as lighthouse:  # the joiner is seen gone after 1 s
        results = run_on_ranks(world, _late_joiner, lighthouse, str(tmp_path))
    for joiner in results[world // 2 :]:
        assert "this replica group's model differs from the 1 replica group(s) it joins" in joiner["error"], joiner
    for trainer in results[: world // 2]:
        log = trainer["log"]
        assert [s for s, committed, _ in log if committed] == list(range(len([e for e in log if e[1]]))), log
        assert any(not committed for _, committed, _ in log), log  # the step the joiner left
        assert log[-1][1], log


# ----- a group killed mid-backward, restarted: the example itself ------------------------------------------
def _run_example(out: Path, *args: str) -> str:
    timeout = hang_timeout()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keeps where torchft is
    env = dict(os.environ, PYTHONPATH=path, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--timeout", str(timeout - 30), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its workers and the lighthouse
        stdout, _ = proc.communicate()
        pytest.fail(f"examples/fault_tolerant.py ran over {timeout} s:\n{stdout[-4000:]}")
    assert proc.returncode == 0, stdout[-4000:]
    return stdout


def _replay(plan: list[tuple[int, list[int]]]) -> dict:
    """Plain code, no torchft: each group's reduced shards all-reduced over the pair of ranks holding the same
    shard in the two groups, a group not in the step contributing zeros, divided by the groups in it."""
    ex = _example()
    mesh = _mesh()
    group_id, pair = mesh["replicate"].get_local_rank(), mesh["replicate"].get_group()
    model, optimizer = ex.build(mesh=mesh["shard"])
    now = []

    def hook(output: torch.Tensor) -> None:
        if group_id not in now:
            output.zero_()
        dist.all_reduce(output, group=pair)
        output.div_(len(now))

    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(hook)
    losses = []
    for step, groups in plan:
        now[:] = groups
        optimizer.zero_grad()
        loss = ex.loss_of(model, dist.get_rank(), step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "shards": ex.shards(model, optimizer)}


@pytest.mark.slow  # the example: a lighthouse, 4 + 2 processes
def test_a_group_killed_mid_backward_and_restarted_ends_bitwise_equal(tmp_path):
    """examples/fault_tolerant.py: group 1's ranks SIGKILL themselves right after step 3's first cross-replica
    all-reduce (one of group 0's three groups already averaged with theirs), the launcher restarts group 1, which
    recovers from group 0. Group 0 throws that attempt away: its final shards and optimizer state equal, bitwise,
    a replay of the steps each group committed (step 3 on group 0's gradients alone), and group 1's equal group
    0's. A half-averaged step committed would fail the replay."""
    # the lighthouse's default heartbeat time-out: a busy machine cannot make it drop a live group
    stdout = _run_example(tmp_path, "--kill-at", "3", "--steps", "6", "--heartbeat-timeout-ms", "5000")
    died = re.search(r"replica group 1 died \(exit codes \[(.*)\]\); restarting it", stdout)
    assert died and "-9" in died.group(1), stdout  # the launcher kills a rank still running
    assert "final shards and optimizer state bitwise equal across replica groups: True" in stdout, stdout
    lives = {g: [json.loads(p.read_text())["log"] for p in sorted(tmp_path.glob(f"log.g{g}r0.life*.json"))] for g in (0, 1)}
    trained = {e["step"] for log in lives[1] for e in log if e["committed"] and e["participating"]}
    first = lives[0][0]
    assert [e["step"] for e in first if not e["committed"]] == [3], first  # the attempt group 1 died in
    plan = [(e["step"], [0, 1] if e["step"] in trained else [0]) for e in first if e["committed"]]
    assert [s for s, _ in plan] == list(range(len(plan))) and plan[3] == (3, [0]), plan
    assert plan[-1][1] == [0, 1] and max(trained) == plan[-1][0], plan
    replayed = run_on_ranks(4, _replay, plan)
    for group in (0, 1):
        for rank in range(2):
            final = torch.load(tmp_path / f"final.g{group}r{rank}.pt")
            _assert_same_shards(final, replayed[rank]["shards"], f"group {group} rank {rank} against the replay")
    for rank in range(2):
        run = json.loads((tmp_path / f"log.g0r{rank}.life0.json").read_text())["log"]
        assert [e["loss"] for e in run if e["committed"]] == replayed[rank]["losses"], rank
    # the replay tells the steps apart: step 3 averaged with group 1's gradients ends elsewhere
    wrong = run_on_ranks(4, _replay, [(s, [0, 1] if s == 3 else g) for s, g in plan])
    final = torch.load(tmp_path / "final.g0r0.pt")
    assert not all(torch.equal(final["params"][n], t) for n, t in wrong[0]["shards"]["params"].items())
