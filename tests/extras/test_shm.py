"""fsdp_compose_shm.use_shm: CPU collectives through /dev/shm give the gloo path's results."""

import glob
import os
import signal
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import fsdp_compose_shm as shm_transport
from fsdp_compose import ShardPlacementResult, fully_shard
from fsdp_compose._runtime.collectives import (
    DIRECT_ALL_GATHER,
    DIRECT_REDUCE_SCATTER,
    CommStats,
    GatherLayout,
    all_gather_flat,
    reduce_scatter_rows,
)
from fsdp_compose._checks.order import ExecutionOrderError
from fsdp_compose._runtime.state import state_of
from fsdp_compose_shm import SHM_ALL_GATHER, SHM_REDUCE_SCATTER, use_shm
from tests.harness import hang_timeout, run_on_ranks
from tests.messages import message
from tests.models import TinyLM, assert_parity, shard_blocks_then_root, train_against_reference
from tests.runtime.test_collectives import count_collectives
from tests.checks.test_divergence import _model as divergence_model

DATA = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")


@contextmanager
def env(**values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def our_files() -> list[str]:
    """Files of this process's shm jobs still linked in /dev/shm."""
    return sorted(f for p in shm_transport._prefixes for f in glob.glob(f"{shm_transport.SHM_DIR}/{p}_*"))


def _use_shm_sets_every_group():
    """Every group of every sharded module, a per-parameter mesh's companion group included, gets the
    transport's collectives (``fully_shard`` alone gives the process group's own), and trains through them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    apart = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), apart) if p.dim() == 1 else None)
    fully_shard(model)
    states = [*state_of(model[0]).call_states, state_of(model)]
    before = {(s.settings.all_gather, s.settings.reduce_scatter) for s in states}
    use_shm(model)
    after = {(s.settings.all_gather, s.settings.reduce_scatter) for s in states}
    gathers, scatters = shm_transport.counters.all_gathers, shm_transport.counters.reduce_scatters
    model(torch.ones(2, 4)).sum().backward()
    used = shm_transport.counters.all_gathers - gathers, shm_transport.counters.reduce_scatters - scatters
    return len(states), before == {(DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER)}, after == {shm_transport.comms()}, used


def test_use_shm_gives_every_group_the_transport():
    # 3 groups, each reduced once; gathered in forward, and again in backward but the root's (kept unsharded)
    assert run_on_ranks(2, _use_shm_sets_every_group) == [(3, True, True, (5, 3))] * 2


def test_use_shm_refuses_what_it_cannot_install_on():
    """A model with no sharded module (use_shm before fully_shard) and a non-module are refused, naming why."""
    assert_expected_inline(message(lambda: use_shm(torch.nn.Linear(2, 2))), """\
ValueError: use_shm(Linear): no module in it is sharded; call fully_shard on it (and its blocks) first, then use_shm""")
    assert_expected_inline(message(lambda: use_shm([torch.nn.Linear(2, 2)])), """\
TypeError: use_shm expects the sharded nn.Module, got list""")


def _parity(variant: str, chunk: str = ""):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if variant == "hsdp" else None
    if chunk:  # a fresh process group: the chunk size is agreed when a group's transport is set up
        mesh = DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu")
    kwargs = {"reshard_after_forward": variant != "keep"}

    def shard(model):
        shard_blocks_then_root(model, mesh=mesh, **kwargs)
        if variant == "separate":  # reduce-scatters on a process group (and so a transport) of their own
            model.set_separate_reduce_scatter_group()
        use_shm(model)

    before = shm_transport.counters.all_gathers, shm_transport.counters.reduce_scatters
    set_ups, syncs = shm_transport.counters.set_ups, shm_transport.counters.syncs
    chunked = {shm_transport.CHUNK_ENV: chunk} if chunk else {}
    with env(**chunked), count_collectives() as counts:
        result = train_against_reference(TinyLM, shard, steps=3)
    result["gloo_data_collectives"] = sum(counts[name] for name in DATA)
    result["shm"] = (shm_transport.counters.all_gathers - before[0], shm_transport.counters.reduce_scatters - before[1])
    result["files"] = our_files()
    result["set_ups"] = shm_transport.counters.set_ups - set_ups
    result["exchanges"] = shm_transport.counters.syncs - syncs - sum(result["shm"])  # beyond one per collective
    result["segment_bytes"] = shm_transport.segment_bytes()
    return result


@pytest.mark.parametrize(
    "world_size,variant,chunk",
    [(2, "separate", ""), (3, "keep", ""), pytest.param(4, "hsdp", "", marks=pytest.mark.slow), (3, "chunked", "256")],
)
def test_parity_with_reference_through_shm(world_size, variant, chunk):
    """``chunked``: 256-byte chunks, so most contributions go in several exchanges."""
    results = run_on_ranks(world_size, _parity, variant, chunk)
    assert_parity(results)
    for r in results:
        assert r["gloo_data_collectives"] == 0, r["gloo_data_collectives"]
        gathers, scatters = r["shm"]
        assert gathers >= 3 * 4 and scatters == 3 * 4, r["shm"]  # 4 groups, 3 steps
        assert r["files"] == []  # outside a growing collective nothing is linked
        assert r["segment_bytes"] > 0
        # once per process group (none if an earlier test set up this pool's world group)
        assert r["set_ups"] <= (2 if variant == "separate" else 1), r["set_ups"]
        if chunk:  # most contributions exceed 256 bytes: several exchanges each
            assert r["exchanges"] > sum(r["shm"]), (r["exchanges"], r["shm"])


class MixedDtypes(torch.nn.Module):
    """One group holding fp32 and bf16 parameters: a byte-level all-gather, one reduce-scatter per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()
        self.scale = torch.nn.Parameter(torch.ones(37, dtype=torch.bfloat16))

    def forward(self, ids):
        return self.lm(ids) * self.scale.float()


def _bitwise_against_gloo():
    out = {}
    for transport in ("gloo", "shm"):
        torch.manual_seed(0)
        model = MixedDtypes()
        for block in model.lm.blocks:
            fully_shard(block)
        fully_shard(model)  # the root group: the fp32 embedding and head, and the bf16 scale
        if transport == "shm":
            use_shm(model)
        assert (state_of(model).group.settings.all_gather is SHM_ALL_GATHER) == (transport == "shm")
        before = shm_transport.counters.reduce_scatters
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(step + dist.get_rank()))
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        used = shm_transport.counters.reduce_scatters - before
        assert used == (3 * 5 if transport == "shm" else 0), used  # 3 blocks + fp32 and bf16 of the root
        out[transport] = (losses, [p.detach().to_local().clone() for p in model.parameters()])
    (gl, gp), (sl, sp) = out["gloo"], out["shm"]
    return all(torch.equal(a, b) for a, b in zip(gl + gp, sl + sp))


def test_bitwise_equal_to_gloo_at_ws2():
    assert run_on_ranks(2, _bitwise_against_gloo) == [True, True]


def _back_to_back(chunk: str):
    """Alternating all-gathers and reduce-scatters of growing and shrinking sizes, each checked,
    while rank 0 reads late (a single shared region, without the two halves, fails this)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    stats = CommStats()
    created = shm_transport.counters.segments_created
    original = shm_transport.ShmTransport._sync

    delay = 0.002 if chunk else 0.02  # 1 KiB chunks sync some 600 times: a shorter lag keeps the test short

    def late_reader(self, *args):  # rank 0 reads each collective's segments late: the others run ahead
        result = original(self, *args)
        time.sleep(delay)
        return result

    if rank == 0:
        shm_transport.ShmTransport._sync = late_reader
    with env(**({shm_transport.CHUNK_ENV: chunk} if chunk else {})):
        for i, n in enumerate([5, 3000, 7, 20000, 1, 20000, 64]):
            pieces = [torch.arange(n, dtype=torch.float32) + 1000 * rank + i, torch.full((2,), float(rank))]
            layout = GatherLayout([4 * (n + 2)], world)
            work, gathered = all_gather_flat(pieces, layout, group, stats, SHM_ALL_GATHER, rank=rank)
            work.wait()
            expected = torch.stack([torch.cat([torch.arange(n) + 1000 * k + i, torch.full((2,), float(k))])
                                    for k in range(world)])
            assert torch.equal(gathered, expected), (i, n)
            table = [torch.arange(world * n, dtype=torch.float64).view(world, n) * (rank + 1) + i]
            work, reduced = reduce_scatter_rows(table, group, stats, comm=SHM_REDUCE_SCATTER)
            expected = sum(torch.arange(world * n, dtype=torch.float64).view(world, n)[rank] * (k + 1) + i
                           for k in range(world))
            assert torch.equal(reduced, expected), (i, n)
    shm_transport.ShmTransport._sync = original
    return shm_transport.counters.segments_created - created, our_files()


@pytest.mark.parametrize("chunk", ["", pytest.param("1024", marks=pytest.mark.slow)])
def test_back_to_back_collectives_of_different_sizes(chunk):
    results = run_on_ranks(3, _back_to_back, chunk)
    for created, files in results:
        # a new segment only when a contribution outgrows the half: the first call, then
        # all-gathers of 3002 and 20002 floats and reduce-scatters of 3x3000 and 3x20000 doubles;
        # with 1 KiB chunks the first half (one page) holds every chunk
        assert created == (1 if chunk else 5), created
        assert files == []


def _diverging_sizes():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    table = [torch.ones(2, 4 + rank)]
    try:
        reduce_scatter_rows(table, group, CommStats(), comm=SHM_REDUCE_SCATTER)
    except ExecutionOrderError as error:
        message = str(error)
    files = our_files()
    # every rank raised, so a later collective sets up afresh and works
    work, reduced = reduce_scatter_rows([torch.ones(2, 3)], group, CommStats(), comm=SHM_REDUCE_SCATTER)
    return message, files, reduced.tolist()


def test_diverging_sizes_named_on_every_rank():
    results = run_on_ranks(2, _diverging_sizes)
    assert results[0][0] == results[1][0]
    assert_expected_inline(results[0][0], """\
Ranks [0, 1] diverged in a shared-memory collective (fsdp_compose_shm): a rank skipped a sharded module or a backward(), or ran them in another order; FSDP_COMPOSE_CHECK_ORDER=1 (the default) names the modules:
  rank 0: reduce-scatter, 32 bytes
  rank 1: reduce-scatter, 40 bytes""")
    for _, files, reduced in results:
        assert files == []
        assert reduced == [2.0, 2.0, 2.0]


def _rank_one_skips_a_module_through_shm() -> tuple[str, int]:
    model = divergence_model()
    use_shm(model)
    syncs = shm_transport.counters.syncs
    try:
        model(torch.randn(3, 4), skip=dist.get_rank() == 1).sum().backward()
        text = "no error"
    except ExecutionOrderError as error:
        text = str(error)
    model.reset_iter_state()
    return text, shm_transport.counters.syncs - syncs


def test_the_core_order_check_names_a_divergence_before_the_transport_sees_it():
    """With the order check on (the default) the core's order check, not the transport's own check, catches
    ranks that diverge through shm, naming the modules; the transport's check guards only the order check off."""
    results = run_on_ranks(2, _rank_one_skips_a_module_through_shm)
    assert results[0] == results[1]
    text, syncs = results[0]
    assert syncs > 0  # the root's all-gather went through shm before the ranks parted
    assert_expected_inline(text, """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'small' (Linear), 40 bytes
  rank 1: all-gather of 'big' (Linear), 120 bytes""")


def _host_mismatch():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    original = shm_transport.host_identity
    if rank == 1:
        shm_transport.host_identity = lambda: "another-host/boot"
    shm_transport._warned = False
    try:
        with warnings.catch_warnings(record=True) as caught, count_collectives() as counts:
            warnings.simplefilter("always")
            pieces = [torch.full((3,), float(rank))]
            work, gathered = all_gather_flat(pieces, GatherLayout([12], 2), group, CommStats(), SHM_ALL_GATHER, rank)
            work.wait()
            # a tensor not on the CPU never takes the shm path
            assert shm_transport.transport_for(group, torch.device("meta")) is None
    finally:
        shm_transport.host_identity = original
    return gathered.tolist(), sum(counts[n] for n in DATA), [str(w.message) for w in caught]


def test_host_mismatch_falls_back_to_gloo_with_a_warning():
    results = run_on_ranks(2, _host_mismatch)
    for gathered, gloo_calls, caught in results:
        assert gathered == [[0.0] * 3, [1.0] * 3]
        assert gloo_calls == 1
        assert_expected_inline("\n".join(caught), """\
fsdp_compose_shm: the ranks of process group [0, 1] are not all on one host with /dev/shm (hostname and boot id differ); using gloo for its collectives""")


def _shm_full():
    """Rank 1's /dev/shm has no room to grow its segment: that collective and the group's later
    ones run over gloo on every rank, with a warning, and give the same results."""
    import errno

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    original = shm_transport._fallocate

    def full(fd, nbytes):
        if nbytes > 2 * 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(fd, nbytes)

    if rank == 1:
        shm_transport._fallocate = full
    gathered = []
    try:
        with warnings.catch_warnings(record=True) as caught, count_collectives() as counts:
            warnings.simplefilter("always")
            for n in (10, 5000, 5000):
                work, out = all_gather_flat([torch.full((n,), float(rank))], GatherLayout([4 * n], 2), group,
                                            CommStats(), SHM_ALL_GATHER, rank)
                work.wait()
                gathered.append(torch.equal(out, torch.stack([torch.zeros(n), torch.ones(n)])))
            work, reduced = reduce_scatter_rows([torch.ones(2, 3000)], group, CommStats(), comm=SHM_REDUCE_SCATTER)
            work.wait()
    finally:
        shm_transport._fallocate = original
    return (gathered, reduced.eq(2).all().item(), sum(counts[n] for n in DATA), our_files(),
            [str(w.message) for w in caught])


def test_full_dev_shm_falls_back_to_gloo_on_every_rank():
    results = run_on_ranks(2, _shm_full)
    for gathered, reduced_ok, gloo_calls, files, _ in results:
        assert gathered == [True, True, True] and reduced_ok
        assert gloo_calls == 3  # the collective that found no room, and the two after it
        assert files == []
    assert_expected_inline("\n".join(r[4][0] for r in results), """\
fsdp_compose_shm: /dev/shm has no room for the segment of rank(s) [1] of process group [0, 1] (see that rank); the group uses gloo from now on. Enlarge /dev/shm (e.g. docker run --shm-size) to keep the transport
fsdp_compose_shm: /dev/shm has no room for the segment of rank(s) [1] of process group [0, 1] (rank 1 could not reserve 40960 bytes in /dev/shm: [Errno 28] No space left on device); the group uses gloo from now on. Enlarge /dev/shm (e.g. docker run --shm-size) to keep the transport""")


def _killed_rank(rank: int, port: int, results) -> None:
    """Rank 1 dies (SIGKILL) right after creating a grown segment, before the sync that would
    unlink it; rank 0's failed sync then unlinks every file of the job."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=hang_timeout(120)),
    )
    group = dist.group.WORLD
    stats = CommStats()
    for n in (10, 10, 10):
        all_gather_flat([torch.ones(n)], GatherLayout([4 * n], 2), group, stats, SHM_ALL_GATHER, rank)
    prefix = next(iter(shm_transport._prefixes))
    if rank == 1:
        original = shm_transport.ShmTransport._sync

        def die(self, *args):
            os.kill(os.getpid(), signal.SIGKILL)

        shm_transport.ShmTransport._sync = die
        del original
    try:
        all_gather_flat([torch.ones(5000)], GatherLayout([20000], 2), group, stats, SHM_ALL_GATHER, rank)
        outcome = "no error"
    except Exception as error:  # noqa: BLE001 - the type is what the test reports
        outcome = type(error).__name__
    if rank == 0:
        results.put((outcome, prefix))


@pytest.mark.slow  # two fresh interpreters
def test_no_files_left_when_a_rank_is_killed_mid_run():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_killed_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outcome, prefix = results.get(timeout=hang_timeout())
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert outcome == "CollectiveError"
    assert procs[1].exitcode == -signal.SIGKILL
    assert glob.glob(f"{shm_transport.SHM_DIR}/{prefix}_*") == []
