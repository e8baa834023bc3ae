"""What every rank raises when ranks diverge, and the entry the handshakes compare.

Ranks agree on each collective before issuing it (``handshake.py``: judged on the host at once on
gloo, where a mismatched collective aborts the process; on the device once per step elsewhere,
``handshake_ledger.py``). Both compare the same entry, (magic, group id, kind, bytes), and name what
each rank was about to run with the lines built here, so a divergence reads the same on any backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable

CHECK_ENV = "FSDP_COMPOSE_CHECK_ORDER"
MODES = ("1", "strict", "0")
MAGIC = 0x4653_4450_4F52_4452
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = 1, 2, 3  # ALL_REDUCE: HSDP's sum across replicas
ONLY_REDUCES = 4  # a handshake for waiting reduce-scatters alone (no collective of its own follows)
KINDS = {ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter", ALL_REDUCE: "all-reduce"}
BACKWARD_KINDS = (REDUCE_SCATTER, ALL_REDUCE)  # issued when a module's backward is done
BACKWARD_HINT = (
    "\n(reduce-scatters, and HSDP's all-reduces across replicas, run when a module's backward is done: ranks "
    "reach different ones when a rank skipped or repeated backward(), ran a different number of micro-batches "
    "without gradient sync, or computed no gradient this step for some parameters of a module it ran, e.g. "
    "skipped computation or an unused branch or expert; such a rank reduces that module only when backward ends)"
)


def fold_digest(digest: int, uid: int, kind: int, nbytes: int) -> int:
    """``digest`` with one more collective (group, kind, bytes) folded in: equal digests mean equal sequences."""
    return (digest * 1_000_003 + (uid * 8 + kind) * 65_537 + nbytes) % ((1 << 61) - 1)


class ExecutionOrderError(RuntimeError):
    """Ranks were about to run different collectives of sharded modules: their forward/backward differ."""


def check_mode() -> str:
    """``FSDP_COMPOSE_CHECK_ORDER``: ``1`` (default), ``strict`` or ``0`` (see docs/schedule.md)."""
    mode = os.environ.get(CHECK_ENV, "1")
    if mode not in MODES:
        raise ValueError(f"{CHECK_ENV}={mode!r}: expected one of {', '.join(MODES)} (docs/schedule.md)")
    return mode


def collective_text(uid: int, kind: int, nbytes: int | None, name_of: Callable[[int], str]) -> str:
    """``all-gather of 'blocks.3' (Block), 1736 bytes`` (``nbytes`` None: size not known)."""
    return f"{KINDS[kind]} of {name_of(uid)}" + ("" if nbytes is None else f", {nbytes} bytes")


def entry_line(rank: int, magic: int, uid: int, kind: int, nbytes: int | None, name_of: Callable[[int], str]) -> str:
    """One rank's line: the collective its entry names."""
    if magic != MAGIC or kind not in KINDS:
        return f"  rank {rank}: <not a fully_shard collective>"
    return f"  rank {rank}: {collective_text(uid, kind, nbytes, name_of)}"


def diverged_message(lines: list[str], kinds: list[int]) -> str:
    """The error every rank raises, from one line per rank named and the collective kinds in them."""
    hint = BACKWARD_HINT if any(kind in BACKWARD_KINDS for kind in kinds) else ""
    return (
        "Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped "
        "a sharded module, ran a different number of forward calls, or ran modules in another order; "
        "check data-dependent control flow):\n" + "\n".join(lines) + hint
    )
