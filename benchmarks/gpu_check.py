"""The GPU check: one command that shows, on one NVIDIA GPU, that fsdp_compose trains right and fast.

    pip install --no-deps -e . && python benchmarks/gpu_check.py    # about 8 minutes at most on one GPU
    python benchmarks/gpu_check.py --quick                           # small sizes (tests/meta/test_gpu_check.py, CPU)

It prints one table, ours beside torch's FSDP2 on the same model and data, and exits non-zero when a
check fails. It needs nothing beyond torch and this checkout (no network, no extras). Without a GPU
it runs the same rows on the CPU and skips those only a GPU has (host syncs, CUDA memory).

- **parity**: the GPT of examples/gpt.py trained sharded against the same model trained unsharded
  on the global batch (SGD with momentum, which sees a wrong gradient scale), comparing losses,
  every rank's gradient shards and parameter shards: fp32 with and without resharding, bf16 mixed
  precision (fp32 reduction), activation checkpointing. Two ranks are two processes sharing the
  device over gloo: NCCL refuses two ranks on one GPU. gloo moves CUDA tensors for the collectives
  it supports for them; the check probes each and stages any other through host memory for both
  libraries alike (the row says so), so the compute, buffers, copies and streams are the GPU's
  and only the wire differs from a cluster. One rank on NCCL adds a row.
- **host syncs** (GPU): steady-state steps under ``torch.cuda.set_sync_debug_mode("error")``, the
  divergence check on, at 1 rank on NCCL and at 8 ranks on the null backend.
- **memory** (GPU): peak ``max_memory_allocated`` and ``max_memory_reserved`` of a step at 8 ranks.
- **step time**: ours / FSDP2 / unsharded at 8 ranks on the null backend (benchmarks/null_backend.py:
  every collective is free and touches nothing, everything else is real, on real device tensors),
  on a GPT of many small layers (where the host's overhead shows) and one of a few large layers;
  and at 1 rank on NCCL (gloo on the CPU).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import importlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "examples")) if p not in sys.path]

from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

from benchmarks import null_backend  # noqa: E402  (registers the "null" backend)
from benchmarks.bench_model import bf16_compute  # noqa: E402

RANK_TIMEOUT_S = 240  # a stuck rank dumps its stacks and exits: the check never hangs
PARITY_MODEL = GPTConfig(vocab_size=97, seq_len=16, dim=32, n_heads=4, n_layers=3)  # 97 rows: uneven shards
PARITY_CONFIGS = ("fp32", "fp32, no reshard", "bf16 mixed precision", "activation checkpointing")


@dataclass
class Row:
    check: str
    ours: str
    torch: str = "-"
    unsharded: str = "-"
    ratio: str = "-"
    verdict: str = "ok"  # "ok", "FAIL: ...", "skip: ...", "info"


# --- models and steps -------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def batch(cfg: GPTConfig, size: int, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=gen).to(device)


def library_api(library: str):
    """The module holding ``fully_shard`` and ``MixedPrecisionPolicy``: "ours" or "torch" (FSDP2)."""
    return importlib.import_module("torch.distributed.fsdp" if library == "torch" else "fsdp_compose")


def shard_gpt(model: GPT, library: str, mesh, **options) -> GPT:
    """One group per block, then the root; ``library`` is "ours" or "torch"."""
    fully_shard = library_api(library).fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def mixed_precision(library: str):
    return library_api(library).MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]


# --- collectives gloo lacks for device tensors: staged through host memory --------------------


# torch 2.13 renamed these (the old names warn there); 2.11 and 2.12 have only the old ones
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class StagedAllGather:
    """All-gather through host memory (both libraries' custom-collective protocol)."""

    calls = 0  # staged collectives run, all classes together: a staged row shows they were used

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        StagedAllGather.calls += 1
        out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
        all_gather_single(out, input_tensor.cpu(), group=group)
        output_tensor.copy_(out)
        return None


class StagedReduceScatter(StagedAllGather):
    """Reduce-scatter through host memory."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        StagedAllGather.calls += 1
        out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
        op = op if isinstance(op, dist.ReduceOp.RedOpType) else dist.ReduceOp.SUM
        reduce_scatter_single(out, input_tensor.cpu(), op=op, group=group)
        output_tensor.copy_(out)
        return None


STAGEABLE = ("all-gather", "reduce-scatter")


def gloo_lacks(device: torch.device, world_size: int) -> list[str]:
    """The data collectives gloo refuses for tensors on ``device`` (none on the CPU)."""
    few, many = torch.ones(4, device=device), torch.ones(4 * world_size, device=device)
    probes = {
        "all-gather": lambda: all_gather_single(torch.empty_like(many), few),
        "reduce-scatter": lambda: reduce_scatter_single(torch.empty_like(few), many),
    }
    lacks = []
    for probe in probes.values():
        try:
            probe()
            lacks.append(0)
        except Exception:  # gloo refuses the device type before any byte moves, on every rank alike
            lacks.append(1)
    flags = torch.tensor(lacks, dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank takes the same path
    return [name for name, lacked in zip(probes, flags.tolist()) if lacked]


# --- parity -----------------------------------------------------------------------------------


def shard_slice(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """``Shard(0)``'s piece of ``full`` on ``rank`` (``torch.chunk``'s split)."""
    chunks = torch.chunk(full, world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, with NaN or inf anywhere counted as infinitely wrong."""
    if a.numel() == 0:
        return 0.0
    return finite_or_inf((a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item())


def finite_or_inf(value: float) -> float:
    """``value``, or inf when it is NaN (Python's ``max`` would drop a NaN)."""
    return value if value == value else float("inf")


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def parity_run(library: str, config: str, cfg: GPTConfig, device, mesh, staged: list[str], steps: int) -> dict:
    """Train ``library``'s sharded model and the unsharded reference on the same data; the worst
    differences in loss, gradient shards and parameter shards, over every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = GPT(cfg).to(device)
    if config == "activation checkpointing":
        reference.blocks = nn.ModuleList(Checkpointed(b) for b in reference.blocks)
    model = copy.deepcopy(reference)
    options = {"reshard_after_forward": config != "fp32, no reshard"}
    if config == "bf16 mixed precision":
        options["mp_policy"] = mixed_precision(library)
    shard_gpt(model, library, mesh, **options)
    for module in sharded_modules(model):
        if "all-gather" in staged:
            module.set_custom_all_gather(StagedAllGather())
        if "reduce-scatter" in staged:
            module.set_custom_reduce_scatter(StagedReduceScatter())
    StagedAllGather.calls = 0
    reference_forward = bf16_compute(reference) if config == "bf16 mixed precision" else reference
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference)]
    per_rank = 2
    loss_diff = grad_diff = 0.0
    for step in range(steps):
        ids = batch(cfg, per_rank * world_size, step, device)
        loss = lm_loss(model, ids[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        logits = reference_forward(ids[:, :-1])
        ref_loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        ref_loss.backward()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        loss_diff = max(loss_diff, finite_or_inf(abs(mean.item() / world_size - ref_loss.item())))
        for p, r in zip(model.parameters(), reference.parameters()):
            if p.grad is not None:
                grad_diff = max(grad_diff, worst(local(p.grad), shard_slice(r.grad, rank, world_size)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    param_diff = max(
        worst(local(p), shard_slice(r, rank, world_size)) for p, r in zip(model.parameters(), reference.parameters())
    )
    sharded = world_size == 1 or all(  # every local piece smaller than its whole (rows permitting)
        local(p).shape[0] < r.shape[0] or r.shape[0] < world_size
        for p, r in zip(model.parameters(), reference.parameters())
    )
    return {
        "loss": max_over_ranks(loss_diff),
        "grad": max_over_ranks(grad_diff),
        "param": max_over_ranks(param_diff),
        "sharded": bool(max_over_ranks(0.0 if sharded else 1.0) == 0.0),
        "staged_calls": StagedAllGather.calls,
    }


def parity_rank(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    staged = list(STAGEABLE) if args.stage else gloo_lacks(device, world_size)
    results = {"staged": staged}
    for config in PARITY_CONFIGS:
        for library in ("ours", "torch"):
            results[f"{config}|{library}"] = parity_run(library, config, PARITY_MODEL, device, mesh, staged,
                                                                   args.parity_steps)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parity_rows(args) -> list[Row]:
    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "parity.json")
        mp.start_processes(parity_rank, args=(world_size, free_port(), args, out_path), nprocs=world_size,
                           start_method="spawn")
        with open(out_path) as f:
            results = json.load(f)
    staged = results.pop("staged")
    wire = "gloo" + (f", {' and '.join(staged)} staged through the host" if staged else "")
    return [
        parity_row(f"parity {config}, 2 ranks ({wire})", config, results[f"{config}|ours"],
                   results[f"{config}|torch"], args)
        for config in PARITY_CONFIGS
    ]


def parity_row(check: str, config: str, ours: dict, theirs: dict, args) -> Row:
    """The worst of loss, gradient and parameter differences: within the tolerance, or no worse than
    twice torch's FSDP2 on the same run (bf16 rounds differently by batch shape)."""
    tol = 1e-2 if config.startswith("bf16") else (1e-4 if args.cuda else 1e-5)
    figure = max(ours["loss"], ours["grad"], ours["param"])
    reference = max(theirs["loss"], theirs["grad"], theirs["param"])
    verdict = "ok"
    if not ours["sharded"]:
        verdict = "FAIL: parameters not sharded"
    elif "staged" in check and not (ours["staged_calls"] and theirs["staged_calls"]):
        verdict = "FAIL: the collectives staged through the host did not run"
    elif not figure <= max(tol, 2 * reference):  # NaN fails too
        verdict = f"FAIL: max diff {figure:.2e} > {tol:.0e} and > 2x torch's"
    return Row(check, f"{figure:.2e}", f"{reference:.2e}", "reference", verdict=verdict)


# --- one process: NCCL at one rank, the null backend at eight ---------------------------------


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def train_step(model, optimizer, ids) -> None:
    lm_loss(model, ids).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(kind: str, cfg: GPTConfig, device, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    return model if kind == "unsharded" else shard_gpt(model, kind, mesh)


def time_steps(kind: str, cfg: GPTConfig, device, mesh, args, batch_size: int) -> dict:
    """Median step time of ``kind`` and, on a GPU, its peak memory over steady-state steps."""
    cuda = device.type == "cuda"
    model = build(kind, cfg, device, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    ids = batch(cfg, batch_size, 0, device)
    for _ in range(2):
        train_step(model, optimizer, ids)
    sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.timing_rounds):
        start = time.perf_counter()
        for _ in range(args.timing_steps):
            train_step(model, optimizer, ids)
        sync(cuda)
        times.append((time.perf_counter() - start) / args.timing_steps)
    out = {"time": sorted(times)[len(times) // 2]}
    if cuda:
        out["allocated"] = torch.cuda.max_memory_allocated()
        out["reserved"] = torch.cuda.max_memory_reserved()
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return out


def host_syncs(kind: str, device, mesh) -> str:
    """"none" when steady-state steps of ``kind`` run under sync-debug mode "error", else the error.
    The model is linear layers and a squared loss, whose own ops never sync (an embedding's backward
    may), so a sync found is the library's; the unsharded run is the control."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8))).to(device)
    if kind != "unsharded":
        for block in model:
            library_api(kind).fully_shard(block, mesh=mesh)
        library_api(kind).fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(16, 256, device=device)

    def step():
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # lazy init, recorded order, cached buffers
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
        return "none"
    except RuntimeError as error:
        return str(error).splitlines()[0][:60]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def sync_row(check: str, device, mesh) -> Row:
    result = {kind: host_syncs(kind, device, mesh) for kind in ("ours", "torch", "unsharded")}
    verdict = "ok" if result["ours"] == "none" else "FAIL: a host sync in a step"
    if result["unsharded"] != "none":
        verdict = "skip: the model itself syncs here"
    return Row(check, result["ours"], result["torch"], result["unsharded"], verdict=verdict)


def single_process_rows(args) -> list[Row]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ["FSDP_COMPOSE_CHECK_ORDER"] = "1"
    cuda = args.cuda
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    small = GPTConfig(vocab_size=512, seq_len=64, dim=128, n_heads=4, n_layers=4 if args.quick else 32)
    large = GPTConfig(vocab_size=8192, seq_len=256, dim=256 if args.quick else 2048, n_heads=16,
                      n_layers=2 if args.quick else 4)
    if not cuda:
        large = GPTConfig(vocab_size=1024, seq_len=64, dim=256, n_heads=8, n_layers=2)
    rows: list[Row] = []

    # one rank on NCCL (gloo without a GPU): parity, host syncs, step time
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    ws1 = f"1 rank, {backend}"
    if cuda:
        rows.append(sync_row(f"host syncs in a step, {ws1} (divergence check on)", device, mesh))
    result = {kind: parity_run(kind, "fp32", PARITY_MODEL, device, mesh, [], args.parity_steps)
              for kind in ("ours", "torch")}
    rows.append(parity_row(f"parity fp32, {ws1}", "fp32", result["ours"], result["torch"], args))
    rows += timing_rows(ws1, {"small layers": small}, device, mesh, args, memory=False)
    dist.destroy_process_group()

    # eight ranks on the null backend: every collective free, the rest real
    dist.init_process_group(null_backend.NAME, store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh(device.type, (8,))
    if cuda:
        rows.append(sync_row("host syncs in a step, 8 ranks, null backend (divergence check on)", device, mesh))
    rows += timing_rows("8 ranks, null backend", {"small layers": small, "large layers": large}, device, mesh, args,
                        memory=cuda)
    dist.destroy_process_group()
    return rows


def timing_rows(where: str, models: dict, device, mesh, args, memory: bool) -> list[Row]:
    rows = []
    for name, cfg in models.items():
        figures = {kind: time_steps(kind, cfg, device, mesh, args, args.batch_size)
                   for kind in ("unsharded", "torch", "ours")}
        label = f"{cfg.n_layers} x dim {cfg.dim}"
        ms = {kind: f"{figures[kind]['time'] * 1e3:.2f} ms" for kind in figures}
        rows.append(Row(f"step time, {name} ({label}), {where}", ms["ours"], ms["torch"], ms["unsharded"],
                        f"{figures['ours']['time'] / figures['torch']['time']:.2f}", verdict="info"))
        if memory:
            for stat in ("allocated", "reserved"):
                mib = {kind: f"{figures[kind][stat] / 2**20:.1f} MiB" for kind in figures}
                rows.append(Row(f"peak memory {stat}, {name}, {where}", mib["ours"], mib["torch"], mib["unsharded"],
                                f"{figures['ours'][stat] / figures['torch'][stat]:.2f}", verdict="info"))
    return rows


# --- the table --------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    header = Row("check", "ours", "torch FSDP2", "unsharded", "ours/FSDP2", "verdict")
    columns = ("check", "ours", "torch", "unsharded", "ratio")
    widths = [max(len(getattr(r, f)) for r in [header, *rows]) for f in columns]
    for r in [header, *rows]:
        cells = [getattr(r, f).ljust(w) for f, w in zip(columns, widths)]
        print("  ".join(cells + [r.verdict]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and few steps (the CPU test)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is present")
    parser.add_argument("--stage", action="store_true",
                        help="stage the parity runs' collectives through host memory even where gloo has them")
    args = parser.parse_args()
    args.cuda = torch.cuda.is_available() and not args.cpu
    args.parity_steps = 3
    args.timing_rounds, args.timing_steps = (3, 2) if args.quick else (5, 10)
    args.batch_size = 2 if args.quick else 8
    device = torch.cuda.get_device_name(0) if args.cuda else "no GPU: CPU rows only"
    print(f"fsdp_compose GPU check: torch {torch.__version__}, Python {platform.python_version()}, {device}")
    start = time.perf_counter()
    rows = parity_rows(args)
    rows += single_process_rows(args)
    if not args.cuda:
        rows.append(Row("host syncs, peak memory", "-", verdict="skip: CUDA only"))
    print_table(rows)
    failed = [r for r in rows if r.verdict.startswith("FAIL")]
    print(f"{len(rows)} rows, {len(failed)} failed, in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
