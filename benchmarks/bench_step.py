"""Benchmark (a), (c), (d): step time, peak memory and bytes moved on real gloo ranks.

    python benchmarks/bench_step.py            # ws 2, GPT ~34M params, batch 4x128, 1 thread/rank
    python benchmarks/bench_step.py --check-off   # also ours without the divergence order check: its cost
    python benchmarks/bench_step.py --transport-shm   # also ours through fsdp_compose_shm.use_shm
    python benchmarks/bench_step.py --quantized int8  # also bf16 mixed precision: torch, ours, ours with
                                                      # quantize_all_gather, compute-only in bf16 (issue 25)

Each rank builds the same model from the same seed and trains it three ways, interleaved
round by round so drift in machine load hits all three alike: torch's FSDP2
(``torch.distributed.fsdp.fully_shard``), ours, and compute-only (the unsharded model on the
rank's batch, no communication). Peak memory is each rank's peak RSS during the steps above
its RSS before the model existed (glibc's mmap threshold is pinned so freed tensors leave RSS),
and, independent of the allocator, the peak live tensor bytes of one further step counted by
storage (``fsdp_compose.extras.observe.storage.StorageTracker``: parameters, optimizer state,
gradients, activations and communication buffers, resizes included).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

# Pinning glibc's mmap threshold makes freed tensors leave RSS at once, so peak RSS measures
# live memory; it also makes every fresh buffer page-fault, which slows both libraries. Time
# with --default-malloc (memory figures then include allocator caching and are not reported).
if "--default-malloc" not in sys.argv:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, lm_loss, synthetic_batch  # noqa: E402

import fsdp_compose_shm as shm_transport  # noqa: E402
from benchmarks.bench_model import CONFIG, bf16_compute, bf16_policy, shard  # noqa: E402
from benchmarks.common import add_step_args, count_bytes, reset_peak_rss, rss_bytes, spawn_ranks  # noqa: E402
from fsdp_compose.extras.observe.storage import StorageTracker  # noqa: E402
from fsdp_compose_shm import segment_bytes, use_shm  # noqa: E402

OURS_UNCHECKED = "ours, checks off"  # --check-off: ours with FSDP_COMPOSE_CHECK_ORDER=0, interleaved
OURS_SHM = "ours, shm"  # --transport-shm: ours, then use_shm on the model, interleaved
# --quantized DTYPE: four more kinds, interleaved, all bf16 mixed precision (params bf16, reduce fp32)
TORCH_BF16 = "torch, bf16"
OURS_BF16 = "ours, bf16"
OURS_QUANTIZED = "ours, bf16 + quantized all-gather"  # quantize_all_gather(model, DTYPE) before fully_shard
COMPUTE_BF16 = "compute-only, bf16"  # the unsharded model, parameters cast to bf16 inside autograd
BF16_KINDS = (TORCH_BF16, OURS_BF16, OURS_QUANTIZED, COMPUTE_BF16)


def make_runner(kind: str, base: GPT, args=None):
    model = copy.deepcopy(base)
    forward = model
    if kind == TORCH_BF16:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard(model, torch_fully_shard, mp_policy=bf16_policy(TorchPolicy))
    elif kind in (OURS_BF16, OURS_QUANTIZED):
        from fsdp_compose import MixedPrecisionPolicy, fully_shard, quantize_all_gather

        if kind == OURS_QUANTIZED:
            quantize_all_gather(model, getattr(torch, args.quantized))
        shard(model, fully_shard, mp_policy=bf16_policy(MixedPrecisionPolicy))
    elif kind == COMPUTE_BF16:
        forward = bf16_compute(model)
    elif kind == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard(model, torch_fully_shard)
    elif kind == "ours":
        from fsdp_compose import fully_shard

        shard(model, fully_shard)
    elif kind == OURS_SHM:
        from fsdp_compose import fully_shard

        shard(model, fully_shard)
        use_shm(model)
    elif kind == OURS_UNCHECKED:  # read when fully_shard runs
        from fsdp_compose import fully_shard
        from fsdp_compose._checks.order import CHECK_ENV

        before = os.environ.get(CHECK_ENV)
        os.environ[CHECK_ENV] = "0"
        try:
            shard(model, fully_shard)
        finally:
            if before is None:
                del os.environ[CHECK_ENV]
            else:
                os.environ[CHECK_ENV] = before
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"step": 0}

    def tracked_peak(batch_size: int) -> int:
        """Peak live tensor bytes of one step, counted by storage from what exists before it."""
        tracker = SegmentBlindTracker()
        tracker.track_training_state(model, optimizer)
        with tracker:
            tracker.reset_peak()
            step(batch_size)
        return tracker.peak

    def step(batch_size: int) -> float:
        batch = synthetic_batch(CONFIG, batch_size, state["step"], dist.get_rank())
        state["step"] += 1
        loss = lm_loss(forward, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step.tracked_peak = tracked_peak
    return step


def segment_storages() -> set[int]:
    """Data pointers of every shared-memory segment this rank has mapped (its own and its peers')."""
    return {
        seg.tensor.untyped_storage().data_ptr()
        for t in list(shm_transport._transports.values()) if t is not None
        for seg in t.peers if seg is not None
    }


class SegmentBlindTracker(StorageTracker):
    """A StorageTracker that skips the shm segments: they are added once, as this rank's own
    segment bytes, instead of once per mapping (a peer's segment is that peer's memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = segment_storages()

    def _see(self, t: object) -> None:
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.untyped_storage().data_ptr() in self.skip:
            return
        super()._see(t)


def time_order_checks() -> dict:
    """From now on, add up the time this rank spends in divergence order checks: the collective log's rounds
    (on gloo one before each all-gather, its 48-byte all-reduce, wait and verdict); only ours in
    the default mode runs them. CPU
    time is their own work; wall time also holds the wait for the other rank, which under load is
    mostly the other rank's lag (the all-gather after it would wait for that anyway), so it is a
    loose upper bound."""
    import time

    from fsdp_compose._checks.order import CollectiveLog

    spent = {"seconds": 0.0, "cpu": 0.0, "calls": 0}
    original = CollectiveLog.close_round

    def timed(collective_log):
        if not collective_log.log:  # nothing to agree on: no collective
            return original(collective_log)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(collective_log)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["cpu"] += time.thread_time() - cpu
            spent["calls"] += 1

    CollectiveLog.close_round = timed
    return spent


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    import time

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    kinds = ["torch", "ours"] + ([OURS_UNCHECKED] if args.check_off else [])
    kinds += ([OURS_SHM] if args.transport_shm else []) + ["compute"] + (list(BF16_KINDS) if args.quantized else [])
    results = {k: {"times": [], "cpu": [], "peak": 0, "live": 0, "bytes": None, "losses": []} for k in kinds}
    for kind in kinds:  # one at a time, so each peak sees only its own model
        torch.manual_seed(0)
        baseline = rss_bytes()
        base = GPT(CONFIG)
        step = make_runner(kind, base, args)
        del base
        for _ in range(args.warmup):
            step(args.batch_size)
        dist.barrier()
        with count_bytes() as moved:
            results[kind]["losses"].append(step(args.batch_size))
        results[kind]["bytes"] = dict(moved)
        reset_peak_rss()
        for _ in range(args.steps_per_round):
            results[kind]["losses"].append(step(args.batch_size))
        results[kind]["peak"] = rss_bytes("VmHWM") - baseline
        dist.barrier()
        results[kind]["live"] = step.tracked_peak(args.batch_size)
        results[kind]["segments"] = segment_bytes()  # only OURS_SHM makes segments; they never shrink
        results[kind]["step"] = step
    order_check = time_order_checks()
    for round_ in range(args.rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:  # alternate who goes first
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()  # process: gloo's threads too
            for _ in range(args.steps_per_round):
                results[kind]["step"](args.batch_size)
            results[kind]["times"].append((time.perf_counter() - start) / args.steps_per_round)
            results[kind]["cpu"].append((time.process_time() - cpu_start) / args.steps_per_round)
    for kind in kinds:
        del results[kind]["step"]
    with_order_checks = 2 if args.transport_shm else 1  # ours and ours-shm run them
    with_order_checks += 2 if args.quantized else 0  # and ours-bf16, ours-bf16-quantized
    results["order checks"] = dict(order_check, steps=args.rounds * args.steps_per_round * with_order_checks)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(gathered, world_size, args)
    dist.destroy_process_group()


def report(per_rank, world_size: int, args) -> None:
    n_params = sum(p.numel() for p in GPT(CONFIG).parameters())
    param_bytes = n_params * 4
    t = {k: statistics.median(per_rank[0][k]["times"]) for k in ("torch", "ours", "compute")}
    peak = {k: max(r[k]["peak"] for r in per_rank) for k in ("torch", "ours", "compute")}
    live = {k: max(r[k]["live"] for r in per_rank) for k in ("torch", "ours", "compute")}
    mib = 1 << 20
    print(f"model: GPT {n_params / 1e6:.1f}M params, ws {world_size}, batch {args.batch_size}x{CONFIG.seq_len}, "
          f"1 thread/rank, {args.rounds} rounds x {args.steps_per_round} steps, medians")
    print(f"(a) step time   torch FSDP2 {t['torch']:.3f}s  ours {t['ours']:.3f}s  compute-only {t['compute']:.3f}s")
    print(f"    ours/torch = {t['ours'] / t['torch']:.3f}  (target <= 0.80)   "
          f"ours/compute = {t['ours'] / t['compute']:.3f} (target <= 1.08)  "
          f"torch/compute = {t['torch'] / t['compute']:.3f}")
    cpu = {k: statistics.median(per_rank[0][k]["cpu"]) for k in ("torch", "ours", "compute")}
    print("    CPU seconds per step (rank 0, all its threads; less sensitive to other load): "
          f"torch {cpu['torch']:.3f}  ours {cpu['ours']:.3f}  compute-only {cpu['compute']:.3f}  "
          f"ours/compute = {cpu['ours'] / cpu['compute']:.3f}")
    if args.default_malloc:
        print("(c) peak RSS not measured: --default-malloc lets the allocator cache freed memory")
    else:
        print_memory(peak, mib)
    print(f"(c) peak live tensor bytes per rank (by storage), max over ranks: torch {live['torch'] / mib:.1f} MiB  "
          f"ours {live['ours'] / mib:.1f} MiB  (unsharded compute-only {live['compute'] / mib:.1f} MiB)")
    print(f"    ours/torch = {live['ours'] / live['torch']:.3f}  (target <= 0.90)   "
          f"ours/compute = {live['ours'] / live['compute']:.3f}")
    print_bytes(per_rank, world_size, param_bytes, mib)
    if args.check_off:
        off = statistics.median(per_rank[0][OURS_UNCHECKED]["times"])
        rounds = per_rank[0]["ours"]["times"], per_rank[0][OURS_UNCHECKED]["times"]
        paired = statistics.median(a / b for a, b in zip(*rounds))
        print(f"(f) divergence order check (issue 12): ours default {t['ours']:.3f}s  checks off {off:.3f}s  "
              f"default/off = {t['ours'] / off:.4f} (ratio of medians), {paired:.4f} (median of per-round "
              "ratios); target <= 1.02")
        off_cpu = statistics.median(per_rank[0][OURS_UNCHECKED]["cpu"])
        print(f"    by CPU seconds per step (rank 0, all threads; blind to waiting, steadier under load): default "
              f"{cpu['ours']:.3f}  off {off_cpu:.3f}  default/off = {cpu['ours'] / off_cpu:.4f}")
    if args.transport_shm:
        print_shm(per_rank, t, cpu, live, mib)
    spent = per_rank[0]["order checks"]
    per_step = spent["seconds"] / spent["steps"]
    cpu = spent["cpu"] / spent["steps"]
    print(f"    inside order checks (rank 0), {spent['calls'] / spent['steps']:.0f} per step: CPU {cpu * 1e3:.2f} ms "
          f"per step = {cpu / t['ours']:.3%} of ours' median step; wall {per_step * 1e3:.2f} ms "
          f"= {per_step / t['ours']:.2%} (includes waiting for the other rank)")
    ours_losses, torch_losses = per_rank[0]["ours"]["losses"], per_rank[0]["torch"]["losses"]
    print(f"    same losses as torch FSDP2: max |diff| over {len(ours_losses)} steps "
          f"{max(abs(a - b) for a, b in zip(ours_losses, torch_losses)):.2e}")
    if args.quantized:
        print_quantized(per_rank, world_size, args, mib)


def print_shm(per_rank, t, cpu, live, mib) -> None:
    shm = statistics.median(per_rank[0][OURS_SHM]["times"])
    shm_cpu = statistics.median(per_rank[0][OURS_SHM]["cpu"])
    segments = max(r[OURS_SHM]["segments"] for r in per_rank)
    shm_live = max(r[OURS_SHM]["live"] + r[OURS_SHM]["segments"] for r in per_rank)
    print(f"(g) ours with fsdp_compose_shm.use_shm: step {shm:.3f}s  "
          f"shm/torch = {shm / t['torch']:.3f} (target <= 0.80)  "
          f"shm/compute = {shm / t['compute']:.3f} (target <= 1.08)  shm/ours-gloo = {shm / t['ours']:.3f}")
    print(f"    CPU seconds per step (rank 0, all threads): shm {shm_cpu:.3f}  ours-gloo {cpu['ours']:.3f}  "
          f"compute-only {cpu['compute']:.3f}  shm/compute = {shm_cpu / cpu['compute']:.3f}")
    print(f"    peak live bytes per rank INCLUDING its shm segment (storage tracker, segments skipped, + the rank's "
          f"own segment bytes {segments / mib:.1f} MiB), max over ranks: {shm_live / mib:.1f} MiB  "
          f"shm/torch = {shm_live / live['torch']:.3f}  (ours-gloo {live['ours'] / mib:.1f} MiB)")
    ours_losses, shm_losses = per_rank[0]["ours"]["losses"], per_rank[0][OURS_SHM]["losses"]
    print(f"    same losses as ours over gloo: max |diff| over {len(shm_losses)} steps "
          f"{max(abs(a - b) for a, b in zip(ours_losses, shm_losses)):.2e}")


def print_quantized(per_rank, world_size: int, args, mib: int) -> None:
    """(h) issue 25: bf16 mixed precision, with and without quantize_all_gather, against torch's and compute-only."""
    names = {TORCH_BF16: "torch", OURS_BF16: "ours", OURS_QUANTIZED: f"ours+{args.quantized}", COMPUTE_BF16: "compute"}
    t = {k: statistics.median(per_rank[0][k]["times"]) for k in BF16_KINDS}
    cpu = {k: statistics.median(per_rank[0][k]["cpu"]) for k in BF16_KINDS}
    live = {k: max(r[k]["live"] for r in per_rank) for k in BF16_KINDS}
    q = OURS_QUANTIZED
    print("(h) bf16 mixed precision (param bf16, reduce fp32), issue 25: "
          f"quantize_all_gather(model, torch.{args.quantized}) before fully_shard")
    print("    step time    " + "  ".join(f"{names[k]} {t[k]:.3f}s" for k in BF16_KINDS) +
          f"  (fp32 compute-only {statistics.median(per_rank[0]['compute']['times']):.3f}s)")
    print(f"    quantized/compute-bf16 = {t[q] / t[COMPUTE_BF16]:.3f} (target <= 1.08)   "
          f"quantized/torch-bf16 = {t[q] / t[TORCH_BF16]:.3f} (target <= 0.75)   "
          f"quantized/ours-bf16 = {t[q] / t[OURS_BF16]:.3f}   ours-bf16/compute-bf16 = "
          f"{t[OURS_BF16] / t[COMPUTE_BF16]:.3f}   torch-bf16/compute-bf16 = {t[TORCH_BF16] / t[COMPUTE_BF16]:.3f}")
    rounds = per_rank[0][q]["times"], per_rank[0][COMPUTE_BF16]["times"], per_rank[0][TORCH_BF16]["times"]
    print(f"    median of per-round ratios: quantized/compute-bf16 "
          f"{statistics.median(a / b for a, b, _ in zip(*rounds)):.3f}  quantized/torch-bf16 "
          f"{statistics.median(a / c for a, _, c in zip(*rounds)):.3f}")
    print("    CPU seconds per step (rank 0, all threads): " +
          "  ".join(f"{names[k]} {cpu[k]:.3f}" for k in BF16_KINDS) +
          f"  quantized/compute-bf16 = {cpu[q] / cpu[COMPUTE_BF16]:.3f}")
    print("    peak live tensor bytes per rank (by storage), max over ranks: " +
          "  ".join(f"{names[k]} {live[k] / mib:.1f} MiB" for k in BF16_KINDS) +
          f"  quantized/ours-bf16 = {live[q] / live[OURS_BF16]:.3f} (target <= 1.0)")
    if not args.default_malloc:
        peak = {k: max(r[k]["peak"] for r in per_rank) for k in BF16_KINDS}
        print("    peak RSS above pre-model baseline, max over ranks: " +
              "  ".join(f"{names[k]} {peak[k] / mib:.1f} MiB" for k in BF16_KINDS))
    moved = {k: per_rank[0][k]["bytes"] for k in (TORCH_BF16, OURS_BF16, q)}
    for k, m in moved.items():
        print(f"    {names[k]:10s} per step: all-gather {m['gather'] / mib:.2f} MiB in {m['gather_calls']} calls, "
              f"reduce-scatter {m['scatter'] / mib:.2f} MiB in {m['scatter_calls']} calls, "
              f"total {(m['gather'] + m['scatter']) / mib:.2f} MiB")
    total = {k: m["gather"] + m["scatter"] for k, m in moved.items()}
    print(f"    all-gather bytes quantized/torch-bf16 = {moved[q]['gather'] / moved[TORCH_BF16]['gather']:.4f} "
          f"(target <= 0.55)   quantized/ours-bf16 = {moved[q]['gather'] / moved[OURS_BF16]['gather']:.4f}   "
          f"total bytes quantized/torch-bf16 = {total[q] / total[TORCH_BF16]:.4f}")
    losses = {k: per_rank[0][k]["losses"] for k in BF16_KINDS}
    diff = max(abs(a - b) for a, b in zip(losses[OURS_BF16], losses[TORCH_BF16]))
    qdiff = max(abs(a - b) / abs(b) for a, b in zip(losses[q], losses[OURS_BF16]))
    print(f"    losses: ours-bf16 vs torch-bf16 max |diff| {diff:.2e} over {len(losses[q])} steps; quantized vs "
          f"ours-bf16 max relative diff {qdiff:.2e} (convergence: benchmarks/quantized_convergence.py)")


def print_memory(peak, mib) -> None:
    print(f"(c) peak RSS above pre-model baseline, max over ranks: torch {peak['torch'] / mib:.1f} MiB  "
          f"ours {peak['ours'] / mib:.1f} MiB  (unsharded compute-only {peak['compute'] / mib:.1f} MiB)")
    print(f"    ours/torch = {peak['ours'] / peak['torch']:.3f}  (target <= 0.95)")


def print_bytes(per_rank, world_size: int, param_bytes: int, mib: int) -> None:
    theory = 3 * (world_size - 1) / world_size * param_bytes
    block_bytes = sum(p.numel() for p in GPT(CONFIG).blocks.parameters()) * 4
    # what this configuration must move: forward gathers all, backward re-gathers the blocks, reduce all
    minimum = (world_size - 1) / world_size * (2 * param_bytes + block_bytes)
    for kind in ("torch", "ours"):
        moved = per_rank[0][kind]["bytes"]
        total = moved["gather"] + moved["scatter"]
        print(f"(d) {kind:5s} per step: all-gather {moved['gather'] / mib:.2f} MiB in {moved['gather_calls']} calls, "
              f"reduce-scatter {moved['scatter'] / mib:.2f} MiB in {moved['scatter_calls']} calls, "
              f"total {total / mib:.2f} MiB = {total / theory:.4f} x 3(N-1)/N*P = {total / minimum:.5f} x minimum")
    print(f"    minimum for this configuration {minimum / mib:.2f} MiB: the root is not resharded after forward "
          "in either library, so its backward all-gather is skipped; the excess is padding")


def main() -> None:
    parser = add_step_args(argparse.ArgumentParser())
    parser.add_argument("--default-malloc", action="store_true", help="time only, with glibc's default allocator")
    parser.add_argument("--check-off", action="store_true",
                        help="also run ours with FSDP_COMPOSE_CHECK_ORDER=0, interleaved, and print default/off")
    parser.add_argument("--transport-shm", action="store_true",
                        help="also run ours through fsdp_compose_shm.use_shm, interleaved, and print its ratios")
    parser.add_argument("--quantized", choices=["int8", "float8_e4m3fn"],
                        help="also run bf16 mixed precision, interleaved: torch FSDP2, ours, ours with "
                        "quantize_all_gather(model, torch.DTYPE) and compute-only in bf16 (issue 25)")
    args = parser.parse_args()
    spawn_ranks(rank_main, args)


if __name__ == "__main__":
    main()
