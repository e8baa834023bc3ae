"""Fingerprint the parity runs' losses, bit for bit, to compare two trees (issue 23: "losses bit-identical").

    python -m tools.parity_fingerprint            # from the repository root; prints one line per run
    diff <(cd OLD && python -m tools.parity_fingerprint) <(python -m tools.parity_fingerprint)

Each run trains ``tests.models.TinyLM`` sharded block by block against the unsharded reference on the
global batch (``tests.models.train_against_reference``) and prints a hash of every rank's losses as
exact hex floats, the first two of rank 0, and the largest parameter and gradient differences from
the reference. Equal lines mean the same numbers to the last bit.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from tests.harness import run_on_ranks
from tests.models import TinyLM, shard_blocks_then_root, train_against_reference

RUNS = (("fp32", 2), ("fp32", 3), ("bf16", 2), ("bf16", 3), ("offload", 3), ("no_reshard", 3), ("reshard_to_2", 4))


def _train(config: str) -> tuple[list[str], float, float]:
    from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {
        "fp32": {},
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "offload": {"offload_policy": CPUOffloadPolicy()},
        "no_reshard": {"reshard_after_forward": False},
        "reshard_to_2": {"reshard_after_forward": 2},
    }[config]
    result = train_against_reference(TinyLM, functools.partial(shard_blocks_then_root, **kwargs))
    return [float(loss).hex() for loss in result["losses"]], result["param_diff"], result["grad_diff"]


def main() -> None:
    for config, world in RUNS:
        results = run_on_ranks(world, _train, config)
        digest = hashlib.sha1(repr([losses for losses, _, _ in results]).encode()).hexdigest()[:12]
        losses, param_diff, grad_diff = results[0]
        diffs = f"param diff {param_diff:.3e}  grad diff {grad_diff:.3e}"
        print(f"{config:12s} ws {world}  losses {digest} {losses[:2]}  {diffs}")


if __name__ == "__main__":
    main()
