"""``benchmarks/bench_fast_paths.py`` switches each fast path off by rewriting a line of the package:
every rewrite must still find its line (else the benchmark would measure nothing), the package must
be as it was afterwards, and a step with a path off must give exactly what the fast path gives."""

import sys

import pytest
import torch
from torch import nn

from benchmarks.bench_fast_paths import FAST_PATHS, switched_off
from fsdp_compose import MixedPrecisionPolicy, fully_shard


def _package_functions() -> dict:
    """Every function and method of the package's modules and classes, by where it is found."""
    found = {}
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("fsdp_compose") and m is not None]:
        for name, value in vars(module).items():
            found[module.__name__, name] = value
            if isinstance(value, type) and value.__module__ == module.__name__:
                found.update({(module.__name__, name, k): v for k, v in vars(value).items() if callable(v)})
    return found


def _step(policy: MixedPrecisionPolicy) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("path", list(FAST_PATHS))
def test_a_step_with_the_path_off_gives_the_same_gradients(single_rank_group, path):
    _step(MixedPrecisionPolicy())  # first-use state (e.g. optimizer_check's one-time install) set before
    before = _package_functions()
    for policy in (MixedPrecisionPolicy(), MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)):
        expected = _step(policy)
        with switched_off(path):
            got = _step(policy)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), path
    after = _package_functions()
    assert [key for key, value in before.items() if after.get(key) is not value] == []  # all restored
