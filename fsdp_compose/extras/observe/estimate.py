"""``estimate(build, world_size)``: will it fit? One fake training step at the target world size.

``build`` is the user's own model-building and sharding code wrapped in a function; it runs in a
fresh subprocess (the caller may hold a real process group) with torch's fake process group at
``world_size`` and the step on fake tensors, so a 70B-parameter model at 512 ranks is planned on
a laptop. The memory is counted by tensor storage (``timeline.py``), as the tests' real runs are.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .explain import fmt_bytes
from .fake_step import (
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    UNSHARDED_GRADIENTS,
    UNSHARDED_PARAMETERS,
)
from .timeline import COLLECTIVE_BUFFERS, UNLABELLED

logger = logging.getLogger(__name__)

# (category, how the table names it), in the table's order
CATEGORIES = [
    (PARAMETERS, "parameters (sharded) and buffers"),
    (GRADIENTS, "gradients (sharded)"),
    (OPTIMIZER_STATE, "optimizer state"),
    (UNSHARDED_PARAMETERS, "unsharded parameters (gathered groups)"),
    (COLLECTIVE_BUFFERS, "all-gather / reduce-scatter buffers"),
    (UNSHARDED_GRADIENTS, "unsharded gradients (before reduce-scatter)"),
    (UNLABELLED, "activations and temporaries"),
]
_ENV_DROPPED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
)


_LIKE = {
    "nccl": "reduce-scatter inputs held until their wait",
    "gloo": "gloo's copies of reduce-scatter inputs and all-gather staging buffers counted",
}


@dataclass
class Estimate:
    """The result of ``estimate``: ``str()`` is the report, ``to_dict()`` the same as JSON-able data.

    Bytes are per rank (rank ``rank``: rank 0 holds the largest shards when sizes do not divide)."""

    world_size: int
    rank: int
    peak_bytes: int  # the step's peak of live tensor storages
    peak_phase: str  # forward, backward or optimizer step
    at_peak: dict[str, int] = field(default_factory=dict)  # category -> bytes live at the peak
    phase_peaks: dict[str, int] = field(default_factory=dict)  # phase -> its own peak
    collectives: dict[str, list[int]] = field(default_factory=dict)  # kind -> [calls, bytes] per step
    plan: str = ""  # explain(model, optimizer) after the warm-up step
    predicted_peak_bytes: int = 0  # explain's prediction (activations excluded)
    peak_without_activations: int = 0  # the step's largest sum of every category but activations
    # like="gloo": the peak were each all-gather's transfer over as soon as issued (gloo's threads decide when
    # it ends: a real step's peak lies between this and peak_bytes); like="nccl": peak_bytes
    settled_peak_bytes: int = 0
    phase_without_activations: str = "-"
    like: str = "nccl"
    build_seconds: float = 0.0
    step_seconds: float = 0.0  # per fake step
    seconds: float = 0.0  # in the subprocess, build included

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        rows = [("memory at the peak (per rank)", "bytes", "share")]
        for key, name in CATEGORIES:
            n = self.at_peak.get(key, 0)
            rows.append((name, fmt_bytes(n), f"{n / max(self.peak_bytes, 1):.0%}"))
        rows.append(("peak", fmt_bytes(self.peak_bytes), f"during {self.peak_phase}"))
        traffic = [("collectives per step", "calls", "bytes")]
        traffic += [(kind, str(calls), fmt_bytes(nbytes)) for kind, (calls, nbytes) in self.collectives.items()]
        phases = ", ".join(f"{p} {fmt_bytes(b)}" for p, b in self.phase_peaks.items())
        settled = []
        if self.settled_peak_bytes != self.peak_bytes:
            settled = [
                "gloo's all-gather buffers are counted until each transfer's latest end; "
                f"were transfers over at once, the peak would be {fmt_bytes(self.settled_peak_bytes)}"
            ]
        return "\n".join(
            [
                f"training steps on fake tensors (a first, then a steady one), rank {self.rank} of "
                f"{self.world_size}, like {self.like} ({_LIKE[self.like]}); "
                f"build {self.build_seconds:.1f} s, {self.step_seconds:.1f} s per fake step",
                "",
                _table(rows),
                f"peak per phase: {phases}",
                *settled,
                f"without activations: {fmt_bytes(self.peak_without_activations)} at most "
                f"(during {self.phase_without_activations}); explain() predicts {fmt_bytes(self.predicted_peak_bytes)}",
                "",
                _table(traffic),
            ]
        )

    def __str__(self) -> str:
        return "\n".join([self.summary(), "", "explain():", self.plan])


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def estimate(
    build: Callable[[], tuple[Any, Any, Callable[[], Any]]],
    world_size: int,
    *,
    rank: int = 0,
    like: str = "nccl",
    warmup_steps: int = 1,
    timeout: float = 600.0,
) -> Estimate:
    """Run one training step of ``build``'s model at ``world_size`` on fake tensors; report per-rank memory.

    ``build()`` is your model-building and sharding code in a function: it creates the model
    (on the ``meta`` device for a large one: nothing is allocated), calls ``fully_shard``, and
    returns ``(model, optimizer, loss_fn)``: the optimizer, or a function of the parameters
    making one; ``loss_fn()`` makes one batch and returns its loss. It runs in a fresh
    subprocess where a fake process group of ``world_size`` ranks is initialized (this is rank
    ``rank``), so ``dist.get_world_size()`` and ``init_device_mesh("cpu", ...)`` work inside it; it
    must not initialize a process group itself. ``build`` is passed by reference: a module-level
    function of an importable module (a function of the ``__main__`` script is sent by value with
    cloudpickle, which must then be installed). The model is then materialized on fake CPU
    tensors (``to_empty``), and ``warmup_steps`` steps (the first records the order and creates the
    optimizer state) and one more run, each forward, backward, ``optimizer.step()``, ``zero_grad()``: the
    peak is the highest of them, the rest of the report the last one's.

    Reported: the peak of live tensor storages and its split (sharded parameters, gradients,
    optimizer state, unsharded parameters, collective buffers, unsharded gradients, everything
    else: activations and temporaries), each phase's peak, collectives per step (calls and bytes
    as ``CommStats`` counts them), and ``explain``'s plan and predicted peak for the same model.
    ``like="nccl"`` keeps each reduce-scatter's input alive until its wait, as NCCL does;
    ``"gloo"`` runs the runtime's gloo paths and counts gloo's own buffers (its copy of each reduce-scatter
    input, an all-gather's staging buffer to its transfer's latest end; ``settled_peak_bytes`` leaves the
    latter out). Not modelled: allocator caching and fragmentation, CUDA context and library workspaces.
    The subprocess is killed after ``timeout`` seconds.
    """
    return estimate_many([(build, world_size, rank)], like=like, warmup_steps=warmup_steps, timeout=timeout)[0]


def estimate_many(
    jobs: list[tuple],
    *,
    like: str = "nccl",
    warmup_steps: int = 1,
    timeout: float = 600.0,
) -> list[Estimate]:
    """``estimate`` for several ``(build, world_size, rank)`` in one subprocess (one interpreter start);
    a job's optional fourth item overrides ``like``."""
    likes = [job[3] if len(job) > 3 else like for job in jobs]
    for each in likes:
        if each not in ("nccl", "gloo"):
            raise ValueError(f"estimate(like={each!r}): 'nccl' or 'gloo'")
    sys_path = [os.path.abspath(p or os.curdir) for p in sys.path]
    spec = {
        "jobs": [
            {
                "world_size": world,
                "rank": rank,
                "warmup_steps": warmup_steps,
                "like": job_like,
                **_reference(build),
            }
            for (build, world, rank, *_), job_like in zip(jobs, likes)
        ],
        "sys_path": sys_path,
    }
    with tempfile.TemporaryDirectory(prefix="fsdp_compose_estimate_") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED and not k.startswith("TORCHELASTIC")}
        env.update(RANK=str(jobs[0][2]), WORLD_SIZE=str(jobs[0][1]), PYTHONPATH=os.pathsep.join(sys_path))
        began = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "fsdp_compose.extras.observe.fake_step", spec_path, out_path],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as error:  # subprocess.run has killed it
            raise TimeoutError(f"estimate: the fake step did not finish in {timeout:.0f} s (killed)") from error
        if done.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"estimate: the fake step failed (exit code {done.returncode}):\n{done.stdout[-4000:]}")
        with open(out_path) as f:
            results = json.load(f)
    logger.info(
        "estimate: %d fake step(s) at world size %s in a subprocess, %.1f s with its start",
        len(jobs), ", ".join(str(world) for _, world, *_ in jobs), time.perf_counter() - began,
    )
    return [Estimate(**result, like=job_like) for result, job_like in zip(results, likes)]


def _reference(build: Callable) -> dict[str, str]:
    """How the subprocess finds ``build``: by module and name, or pickled by value from ``__main__``."""
    module, qualname = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module == "__main__" and main_spec is not None:  # run with ``python -m package.module``: importable
        module = main_spec.name
    if module and module != "__main__" and "<" not in qualname:
        return {"module": module, "qualname": qualname}
    try:
        import cloudpickle
    except ImportError as error:
        raise TypeError(
            f"estimate: build ({qualname or build!r}) must be a module-level function of an importable module "
            "(functions of the __main__ script need cloudpickle installed)"
        ) from error
    return {"pickled": base64.b64encode(cloudpickle.dumps(build)).decode()}
