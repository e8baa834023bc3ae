import faulthandler
import signal
import sys
import threading

import pytest
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.harness import close_pools, hang_timeout

_deselected: list[pytest.Item] = []


def pytest_configure(config: pytest.Config) -> None:
    """Enter a fake-tensor mode once in this process's main thread, before any test does in another.

    On torch 2.11's CUDA builds without a GPU, the first ``FakeTensorMode`` entered (DTensor's sharding
    propagation enters one) points the CUDA device guard at an object owned by that thread. When the thread
    ends (a threaded-rank test, a step run in a worker thread) the pointer dangles, and the next
    ``nn.Parameter(DTensor)`` segfaulted. Made here, the object lives as long as the session. 2.14 keeps it
    per thread and needs none of this; it costs nothing there.
    """
    with FakeTensorMode():
        pass


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_pools()  # here, not only at exit: an xdist worker ends with os._exit, which runs no atexit hook


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
    tears the default group down."""
    if dist.is_initialized() and (dist.get_world_size() != 1 or dist.get_backend() != "gloo"):
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


# the longest test takes about 190 s on a quiet 2-core machine; a never-low case measured three times, 430 s
HANG_LIMIT_S = hang_timeout(1800)


class HungTest(AssertionError):
    """A test ran past ``HANG_LIMIT_S``: something waits for ever."""


def _raise_hung(signum, frame) -> None:
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    raise HungTest(f"still running after {HANG_LIMIT_S:.0f} s: a hang (every thread's stack is on stderr)")


@pytest.fixture(autouse=True)
def _end_a_hung_test():
    """A hang nothing else caught fails its test, and only it, instead of stopping the whole CI run.

    ``SIGALRM`` raises in the test's thread (pytest runs tests in the main thread; xdist's workers too), which
    every wait the tests use (queue, join, sleep) lets through. Should the thread be stuck where no signal
    reaches Python, faulthandler ends the process a minute later: a crash, which xdist reports, but with
    ``--dist loadfile`` it also runs the rest of that file again, so it is only the fallback.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_hung)
    signal.alarm(int(HANG_LIMIT_S))
    faulthandler.dump_traceback_later(HANG_LIMIT_S + 60, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
