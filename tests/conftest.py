import pytest
import torch.distributed as dist

_deselected: list[pytest.Item] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(items)  # e.g. the slow tests pyproject.toml's addopts leaves out


@pytest.fixture(scope="session")
def collected_items(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """Every test this session collected, the deselected ones (``-m``, ``-k``) included."""
    return [*request.session.items, *_deselected]


@pytest.fixture
def single_rank_group():
    """A world-size-1 gloo group in the test process, for checks that need no peers. Made again when an
    earlier test left none or another world behind: a threaded-rank test (torch's ``MultiThreadedTestCase``)
    tears the default group down, and a model sharded on what is left crashed torch 2.11 in ``nn.Parameter``."""
    if dist.is_initialized() and (dist.get_world_size() != 1 or dist.get_backend() != "gloo"):
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
