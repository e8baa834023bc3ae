"""Issue 54, item 2: what ``fully_shard`` installs for the whole process is listed by ``process_wide_effects()``,
each installed once, only where the program can use it, and kept out by naming it in ``FSDP_COMPOSE_DISABLE``.

Installs are once per process, so each case runs in a fresh interpreter (``python -m
tests.runtime.test_process_wide <case>``), which prints what it finds in place: the registry's names, our finder
in ``sys.meta_path``, our optimizer step pre-hook among torch's global ones, our exit handler among those
registered with ``atexit``.
"""

import atexit
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _global_optimizer_pre_hooks

from fsdp_compose import fully_shard, process_wide_effects
from fsdp_compose._checks import optimizer
from fsdp_compose._runtime.process_wide import DISABLE_ENV, OPT_OUTS
from fsdp_compose._torch_workarounds import gloo_exit, pipelining

ROOT = Path(__file__).resolve().parents[2]


def _in_place(exit_handlers: list) -> str:
    """What of ours is in place in this process, in one line."""
    hooks = _global_optimizer_pre_hooks.values()
    stage = sys.modules.get(pipelining.STAGE)
    patched = stage is not None and hasattr(stage._PipelineStageBase.perform_reduce_grad, pipelining._OURS)
    return (
        f"listed: {', '.join(process_wide_effects()) or '-'}; "
        f"finder: {sum(isinstance(f, pipelining._InstallOnImport) for f in sys.meta_path)}, "
        f"optimizer hook: {sum(h is optimizer._check_first_step for h in hooks)}, "
        f"exit handler: {exit_handlers.count(gloo_exit.drain_gloo_workers)}, "
        f"pipelining patched: {patched}"
    )


def _case(case: str) -> None:
    """Shard two modules as ``case`` says, printing what is in place after, and after importing pipelining."""
    exit_handlers = []
    register = atexit.register
    atexit.register = lambda fn, *args, **kwargs: exit_handlers.append(fn) or register(fn, *args, **kwargs)
    if case.startswith("disable_"):
        os.environ[DISABLE_ENV] = case.removeprefix("disable_")
    if case == "unused":  # a program that cannot use pipelining, on a process group that is not gloo
        from torch.testing._internal.distributed.fake_pg import FakeStore

        sys.modules[pipelining.PACKAGE] = None  # what makes an import fail, as for a torch without it
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if case == "imported_before":
        import torch.distributed.pipelining  # noqa: F401
    fully_shard(nn.Linear(2, 2))
    fully_shard(nn.Linear(2, 2))  # a second call installs nothing more
    print(_in_place(exit_handlers))
    if case != "unused":
        import torch.distributed.pipelining  # noqa: F401,F811

        print(_in_place(exit_handlers))


def _run(case: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.test_process_wide", case],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fully_shard_lists_what_it_installed_and_the_import_hook_hands_over():
    assert_expected_inline(_run("default"), """\
listed: optimizer_check, pipelining_import_hook, exit_drain; finder: 1, optimizer hook: 1, exit handler: 1, pipelining patched: False
listed: optimizer_check, exit_drain, pipelining; finder: 0, optimizer hook: 1, exit handler: 1, pipelining patched: True
""")


@pytest.mark.slow  # a fresh interpreter
def test_pipelining_imported_first_is_patched_at_once_without_a_finder():
    assert_expected_inline(_run("imported_before"), """\
listed: optimizer_check, pipelining, exit_drain; finder: 0, optimizer hook: 1, exit handler: 1, pipelining patched: True
listed: optimizer_check, pipelining, exit_drain; finder: 0, optimizer hook: 1, exit handler: 1, pipelining patched: True
""")


def test_nothing_installed_that_the_program_cannot_use():
    # pipelining not importable: no finder; a process group that is not gloo: no exit handler
    assert_expected_inline(_run("unused"), """\
listed: optimizer_check; finder: 0, optimizer hook: 1, exit handler: 0, pipelining patched: False
""")


@pytest.mark.slow  # a fresh interpreter
def test_optimizer_check_opt_out():
    assert_expected_inline(_run("disable_optimizer_check"), """\
listed: pipelining_import_hook, exit_drain; finder: 1, optimizer hook: 0, exit handler: 1, pipelining patched: False
listed: exit_drain, pipelining; finder: 0, optimizer hook: 0, exit handler: 1, pipelining patched: True
""")


@pytest.mark.slow  # a fresh interpreter
def test_pipelining_opt_out_keeps_the_finder_and_the_patches_out():
    assert_expected_inline(_run("disable_pipelining"), """\
listed: optimizer_check, exit_drain; finder: 0, optimizer hook: 1, exit handler: 1, pipelining patched: False
listed: optimizer_check, exit_drain; finder: 0, optimizer hook: 1, exit handler: 1, pipelining patched: False
""")


@pytest.mark.slow  # a fresh interpreter
def test_exit_drain_opt_out():
    assert_expected_inline(_run("disable_exit_drain"), """\
listed: optimizer_check, pipelining_import_hook; finder: 1, optimizer hook: 1, exit handler: 0, pipelining patched: False
listed: optimizer_check, pipelining; finder: 0, optimizer hook: 1, exit handler: 0, pipelining patched: True
""")


def test_an_unknown_opt_out_raises_before_fully_shard_changes_the_module(single_rank_group, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "exit_drain,optimiser_check")
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError) as caught:
        fully_shard(module)
    assert_expected_inline(str(caught.value), """\
FSDP_COMPOSE_DISABLE='exit_drain,optimiser_check': unknown 'optimiser_check'; expected comma-separated names from optimizer_check, pipelining, exit_drain, weights_check (docs/troubleshooting.md, 'Process-wide effects')""")
    assert not isinstance(module.weight, DTensor)


def test_each_effect_says_why_and_how_to_keep_it_out(single_rank_group):
    fully_shard(nn.Linear(2, 2))
    effects = process_wide_effects()
    assert "optimizer_check" in effects and "exit_drain" in effects, effects  # a 1-rank gloo group
    for name, effect in effects.items():
        assert effect.why and effect.opt_out.split("=") in ([DISABLE_ENV, name], [DISABLE_ENV, "pipelining"]), effect


if __name__ == "__main__":
    _case(sys.argv[1])
