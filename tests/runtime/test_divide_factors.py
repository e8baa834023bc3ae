"""The gradient divide policy as one pure function (``_runtime/group.py:divide_factors``), without a process group:
the collectives only sum, and ``pre * post`` is always the whole divisor."""

import pytest
import torch

from fsdp_compose._runtime.group import divide_factors


@pytest.mark.parametrize(
    "dtype, world, dp_size, factor, expected",
    [
        (torch.float32, 4, 4, None, (1, 4.0)),  # wide dtypes divide once, after the sum
        (torch.float32, 2, 8, None, (1, 8.0)),  # HSDP: by the whole data-parallel size
        (torch.float64, 4, 4, 2.0, (1, 2.0)),  # set_gradient_divide_factor
        (torch.bfloat16, 4, 4, None, (4, 1.0)),  # 2-byte dtypes divide before, so the sum cannot overflow
        (torch.float16, 2, 8, None, (2, 4.0)),  # HSDP: the shard world before, the replicas after
        (torch.bfloat16, 4, 4, 8.0, (8.0, 1.0)),  # a set factor: all of it before
        (torch.bfloat16, 4, 4, 1.0, (1.0, 1.0)),  # the plain sum
    ],
)
def test_divide_factors(dtype, world, dp_size, factor, expected):
    pre, post = divide_factors(dtype, world, dp_size, factor)
    assert (pre, post) == expected
    assert pre * post == (dp_size if factor is None else factor)
