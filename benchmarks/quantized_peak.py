"""Which tensors are alive at the peak of one step, with and without ``quantize_all_gather``.

    python benchmarks/quantized_peak.py [--batch-size 4] [--top 25]

Counts live storages like ``bench_step.py``'s peak figure (``StorageTracker``: the parameters,
buffers and optimizer state that exist before the step, plus every storage an operator touches
during it), on the benchmark GPT with bf16 mixed precision over 2 gloo ranks. Each storage is
labelled where it was first seen (the innermost frame in fsdp_compose, the model or autograd),
and at the step's peak the live bytes are summed per label, so the two runs can be compared
label by label: what the quantized run holds at its peak that the unquantized one does not.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "examples")) if p not in sys.path]

from gpt import GPT, lm_loss, synthetic_batch  # noqa: E402

from benchmarks.bench_model import CONFIG, bf16_policy, shard  # noqa: E402
from benchmarks.common import spawn_ranks  # noqa: E402
from fsdp_compose.extras.observe.storage import StorageTracker  # noqa: E402

_OURS = os.sep + "fsdp_compose" + os.sep
_SKIP = (os.path.join("fsdp_compose", "observe"), "torch" + os.sep + "utils" + os.sep + "_python_dispatch")


def _site() -> str:
    """The innermost frame worth naming: fsdp_compose's runtime, the model, or the caller."""
    frame = sys._getframe(3)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(s in name for s in _SKIP):
            if _OURS in name or name.endswith("gpt.py"):
                return f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}"
            fallback = fallback or f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


class LabelledTracker(StorageTracker):
    """A StorageTracker that remembers, per storage, where it was first seen and its dtype, and
    the live storages (with labels) at the moment the peak was last raised."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[int, str] = {}
        self.at_peak: dict[int, tuple[str, int]] = {}
        self.label_next = "?"

    def _see(self, t: object) -> None:
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            key = id(t.untyped_storage())
            if key not in self._refs:
                self.label_next = f"{str(t.dtype).removeprefix('torch.')} {_site()}"
        super()._see(t)

    def _add(self, key, storage) -> None:
        self.labels[key] = self.label_next
        super()._add(key, storage)
        self._snapshot()

    def _resized(self, storage) -> None:
        key = id(storage)
        if key not in self._refs:
            self.label_next = f"resized {_site()}"
        else:
            self.labels[key] = self.labels.get(key, "?").split(" | ")[0] + f" | resized {_site()}"
        super()._resized(storage)
        self._snapshot()

    def _snapshot(self) -> None:
        if self.current == self.peak:
            self.at_peak = {k: (self.labels.get(k, "?"), n) for k, n in self._sizes.items() if n}
            self.peak_site = _site()


def measure(quantized: bool, args, rank: int) -> tuple[int, int, Counter, str]:
    """One tracked step after ``args.warmup`` steps: (step peak, forward peak, bytes by label at the
    step's peak, where the peak was reached)."""
    from fsdp_compose import MixedPrecisionPolicy, fully_shard, quantize_all_gather

    torch.manual_seed(0)
    model = GPT(CONFIG)
    if quantized:
        quantize_all_gather(model, torch.int8)
    shard(model, fully_shard, mp_policy=bf16_policy(MixedPrecisionPolicy))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward_peak = []

    def step(i: int) -> None:
        loss = lm_loss(model, synthetic_batch(CONFIG, args.batch_size, i, rank))
        forward_peak.append(tracker.peak)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    tracker = StorageTracker()  # a throwaway one for the warm-up steps
    for i in range(args.warmup):
        step(i)
    tracker = LabelledTracker()
    tracker.label_next = "state before the step"
    tracker.track_training_state(model, optimizer)
    with tracker:
        tracker.reset_peak()
        step(args.warmup)
    by_label = Counter()
    for label, nbytes in tracker.at_peak.values():
        by_label[label] += nbytes
    return tracker.peak, forward_peak[-1], by_label, tracker.peak_site


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {quantized: measure(quantized, args, rank) for quantized in (False, True)}
    if rank == 0:
        report(results, args.top)
    dist.destroy_process_group()


def report(results, top: int) -> None:
    mib = 1 << 20
    (plain, plain_forward, plain_labels, plain_site) = results[False]
    (quant, quant_forward, quant_labels, quant_site) = results[True]
    print(
        f"peak live bytes of a step, rank 0: unquantized {plain / mib:.2f} MiB  quantized {quant / mib:.2f} MiB  "
        f"({quant / plain:.4f}x)"
    )
    print(
        f"  of its forward: unquantized {plain_forward / mib:.2f} MiB  quantized {quant_forward / mib:.2f} MiB  "
        f"({quant_forward / plain_forward:.4f}x)"
    )
    print(f"step's peak reached at: unquantized {plain_site}; quantized {quant_site}")
    labels = set(plain_labels) | set(quant_labels)
    rows = sorted(labels, key=lambda k: -abs(quant_labels[k] - plain_labels[k]))
    print(f"{'unquantized':>12} {'quantized':>12} {'difference':>12}  MiB live at the step's peak, by where first seen")
    for label in rows[:top]:
        a, b = plain_labels[label] / mib, quant_labels[label] / mib
        print(f"{a:12.2f} {b:12.2f} {b - a:+12.2f}  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    args.world_size = 2
    spawn_ranks(rank_main, args)


if __name__ == "__main__":
    main()
