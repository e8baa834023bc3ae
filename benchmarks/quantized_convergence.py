"""Issue 25, item 3: does training converge the same with quantize_all_gather? Shown on 2 gloo ranks.

    python benchmarks/quantized_convergence.py                 # 200 steps, int8, batch 4 per rank
    python benchmarks/quantized_convergence.py --dtype float8_e4m3fn --plot /tmp/f8.png

Each rank builds bench_step.py's GPT (~34M parameters) twice from the same seed and shards both
with bf16 mixed precision (params bf16, gradient reduction fp32), one of them after
``quantize_all_gather(model, dtype)``. Both train on the same batches, step by step in turn, with
AdamW. Logged per step: the loss averaged over both ranks, computed in fp32 from the logits (a
bf16 loss would hide differences below its ~0.4% resolution). The verdict compares the mean of
the last ``--tail`` steps' losses, which evens out step-to-step noise. The curves are printed as
text and, if matplotlib is installed, drawn overlaid into a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpt import synthetic_batch  # noqa: E402

from benchmarks.bench_model import CONFIG, GPT, bf16_policy, shard  # noqa: E402
from benchmarks.common import spawn_ranks  # noqa: E402
from fsdp_compose import MixedPrecisionPolicy, fully_shard, quantize_all_gather  # noqa: E402

DEFAULT_PLOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "images", "quantized_convergence.png"
)


def fp32_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def build(config, quantized_dtype: torch.dtype | None, lr: float):
    torch.manual_seed(0)
    model = GPT(config)
    if quantized_dtype is not None:
        quantize_all_gather(model, quantized_dtype)
    shard(model, fully_shard, mp_policy=bf16_policy(MixedPrecisionPolicy))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    config = dataclasses.replace(CONFIG, seq_len=args.seq_len)
    runs = {"bf16": build(config, None, args.lr), args.dtype: build(config, getattr(torch, args.dtype), args.lr)}
    curves = {name: [] for name in runs}
    start = time.perf_counter()
    for step in range(args.steps):
        batch = synthetic_batch(config, args.batch_size, step, rank)
        for name, (model, optimizer) in runs.items():
            loss = fp32_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            curves[name].append(mean.item() / world_size)
        if rank == 0 and (step < 3 or (step + 1) % 10 == 0):
            elapsed = time.perf_counter() - start
            print(
                f"step {step + 1:4d}/{args.steps}  "
                + "  ".join(f"{n} {c[-1]:.4f}" for n, c in curves.items())
                + f"  ({elapsed:.0f}s, {elapsed / (step + 1):.2f}s per step of both)",
                flush=True,
            )
    if rank == 0:
        report(curves, args, config, time.perf_counter() - start)
    dist.destroy_process_group()


def report(curves: dict, args, config, seconds: float) -> None:
    plain, quantized = curves["bf16"], curves[args.dtype]
    print(
        f"\nGPT {sum(p.numel() for p in GPT(config).parameters()) / 1e6:.1f}M params, ws {args.world_size} gloo, "
        f"batch {args.batch_size}x{config.seq_len} per rank, AdamW lr {args.lr}, {args.steps} steps, "
        f"bf16 mixed precision (reduce fp32); {seconds / 60:.1f} min for both runs"
    )
    print("step  loss bf16  loss bf16+" + args.dtype + "  relative diff")
    for i, (a, b) in enumerate(zip(plain, quantized)):
        print(f"{i + 1:4d}  {a:9.4f}  {b:9.4f}  {(b - a) / a:+.3%}")
    tail_plain, tail_quantized = statistics.mean(plain[-args.tail :]), statistics.mean(quantized[-args.tail :])
    diff = (tail_quantized - tail_plain) / tail_plain
    verdict = "met" if abs(diff) <= 0.01 else "NOT met"
    print(
        f"final loss (mean of the last {args.tail} steps): bf16 {tail_plain:.4f}  bf16+{args.dtype} "
        f"{tail_quantized:.4f}  relative diff {diff:+.3%} (target within 1%: {verdict})"
    )
    print(
        f"last step alone: bf16 {plain[-1]:.4f}  bf16+{args.dtype} {quantized[-1]:.4f}  "
        f"relative diff {(quantized[-1] - plain[-1]) / plain[-1]:+.3%}; "
        f"largest per-step |relative diff| {max(abs(b - a) / a for a, b in zip(plain, quantized)):.3%}"
    )
    plot(plain, quantized, args, config, diff)


def plot(plain: list[float], quantized: list[float], args, config, diff: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to draw one)")
        return
    steps = range(1, len(plain) + 1)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, plain, label="bf16 mixed precision", linewidth=1.6)
    ax.plot(
        steps, quantized, label=f"bf16 + {args.dtype} all-gather (quantize_all_gather)", linewidth=1.2, linestyle="--"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of 2 ranks)")
    ax.set_title(
        f"GPT 34M, 2 gloo ranks, batch {args.batch_size}x{config.seq_len} per rank: "
        f"last-{args.tail} mean differs by {diff:+.2%}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot)
    print(f"plot written to {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=CONFIG.seq_len)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--dtype", choices=["int8", "float8_e4m3fn"], default="int8")
    parser.add_argument("--tail", type=int, default=10, help="steps averaged for the final loss")
    parser.add_argument("--plot", default=DEFAULT_PLOT)
    spawn_ranks(rank_main, parser.parse_args())


if __name__ == "__main__":
    main()
