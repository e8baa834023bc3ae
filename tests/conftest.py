import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """A world-size-1 gloo group in the test process, for checks that need no peers."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
