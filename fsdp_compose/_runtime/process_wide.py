"""The process-wide effects of ``fully_shard``: each installed once, by name, with why, unless opted out.

A hook, an import finder or an exit handler outlives the modules that asked for it and reaches code that never
called ``fully_shard`` (every optimizer, every import, the interpreter's exit), so none is installed quietly:
each goes through ``install_once``, which runs it once per process unless its name is in ``FSDP_COMPOSE_DISABLE``,
and records it for ``fsdp_compose.process_wide_effects()``. The weights check is no install (a collective at each
``fully_shard``), but its opt-out is read here too, so every opt-out is a name of the one variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

DISABLE_ENV = "FSDP_COMPOSE_DISABLE"
# the names FSDP_COMPOSE_DISABLE may hold (comma-separated), one per row of the table in process_wide_effects
OPT_OUTS = ("optimizer_check", "pipelining", "exit_drain", "weights_check")


class Effect(NamedTuple):
    """One installed effect: why it is there, and the setting that keeps it out."""

    why: str
    opt_out: str


_installed: dict[str, Effect] = {}
logger = logging.getLogger(__name__)


def disabled(opt_out: str) -> bool:
    """Whether ``FSDP_COMPOSE_DISABLE`` names ``opt_out`` (one of ``OPT_OUTS``); a name it does not know raises,
    so a misspelt opt-out is not silently ignored."""
    raw = os.environ.get(DISABLE_ENV, "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = sorted(names - set(OPT_OUTS))
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV}={raw!r}: unknown {', '.join(map(repr, unknown))}; expected comma-separated names "
            f"from {', '.join(OPT_OUTS)} (docs/troubleshooting.md, 'Process-wide effects')"
        )
    return opt_out in names


def install_once(name: str, why: str, install: Callable[[], object], opt_out: str | None = None) -> bool:
    """Run ``install`` and record ``name`` with ``why``, unless ``name`` is recorded already or ``opt_out``
    (default: ``name``) is disabled; whether ``name`` is installed now."""
    if name in _installed:
        return True
    opt_out = opt_out or name
    if disabled(opt_out):
        return False
    install()
    _installed[name] = Effect(why, f"{DISABLE_ENV}={opt_out}")
    logger.debug("installed %s: %s", name, why)
    return True


def forget(name: str) -> None:
    """``name`` is no longer in place (it removed itself, or what it patched was replaced)."""
    _installed.pop(name, None)


def process_wide_effects() -> dict[str, Effect]:
    """What ``fully_shard`` installed in this process, for the whole process: name -> ``Effect(why, opt_out)``.

    Each is installed by the first ``fully_shard`` that needs it, once, and stays for the process; every one is
    kept out by naming it in ``FSDP_COMPOSE_DISABLE`` (comma-separated, read at each ``fully_shard``; an
    unknown name raises):

    - ``optimizer_check`` (``FSDP_COMPOSE_DISABLE=optimizer_check``): a global optimizer step pre-hook. An
      optimizer built before ``fully_shard`` raises at its first step; unmanaged parameters whose gradients
      differ across ranks warn.
    - ``pipelining`` (``FSDP_COMPOSE_DISABLE=pipelining``): torch.distributed.pipelining's schedules patched to
      reduce our stages' gradients once per step; only once the program imported it.
    - ``pipelining_import_hook`` (``FSDP_COMPOSE_DISABLE=pipelining``): a ``sys.meta_path`` finder that installs
      ``pipelining`` when the program imports it; only while pipelining is importable and not imported yet,
      and gone once it fired.
    - ``exit_drain`` (``FSDP_COMPOSE_DISABLE=exit_drain``): an ``atexit`` handler that lets gloo's worker
      threads finish before the interpreter finalizes; only when a gloo process group is in use.

    Not an install, so never listed here, but opted out the same way: ``weights_check``
    (``FSDP_COMPOSE_DISABLE=weights_check``, or the older ``FSDP_COMPOSE_CHECK_INIT=0``), one all-reduce per
    ``fully_shard`` call comparing the ranks' weights. The same table is in docs/troubleshooting.md.
    """
    return dict(_installed)
