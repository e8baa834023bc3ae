"""At exit, gloo's worker threads finish with the GIL before the interpreter finalizes.

Upstream: pytorch/pytorch#190489 (open: "terminate called without an active exception" at exit on gloo) and
pytorch/pytorch#179291 (an ``atexit`` ``destroy_process_group`` in ``init_process_group``, abandoned upstream as
"much more complicated than I anticipated"); here the abort came with ``destroy_process_group()`` called too.
Applies to torch 2.11 to 2.14.1, the supported range: no release fixes it.

gloo runs each collective on a worker thread (``pt_gloo_runloop``), which lets go of the finished
``Work`` a moment after the caller's wait returned. When it holds the last reference and the
``Work`` holds Python objects (tensors whose Python object died first, a thread-local state
captured in backward or under the profiler), freeing it takes the GIL. Once the interpreter
finalizes, CPython ends a thread that asks for the GIL, here inside a ``noexcept`` destructor:
"terminate called without an active exception" and SIGABRT, after a run that did all its work.
Whoever issued the collective (us, the user's loop, DTensor in ``clip_grad_norm_``, a trainer, a
checkpoint save), the thread is gloo's, so the measure is process-wide: the first ``fully_shard`` on a
gloo group (its own or the default one) registers ``drain_gloo_workers`` to run at exit, before
finalization, as the process-wide effect ``exit_drain`` (``FSDP_COMPOSE_DISABLE=exit_drain`` keeps it out).
It releases the GIL until every gloo worker thread has been still for a whole interval (neither runnable nor
switched in or out: a thread waiting for the GIL wakes every 5 ms, and takes it once free), at most
``LIMIT_S``. It never communicates, so ranks that exit at different times or after a failure do not wait for
each other, and with ``destroy_process_group()`` skipped the idle threads are simply left for the
interpreter. On NCCL alone nothing is registered; where no gloo worker thread is left it reads one directory
and returns; without ``/proc`` (not Linux) it releases the GIL for ``FALLBACK_S`` once.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

import torch.distributed as dist

from .._runtime.process_wide import install_once

WORKER_NAME = "pt_gloo_runloop"  # the name torch 2.11 to 2.14 give gloo's worker threads
STILL_S = 0.015  # longer than two of CPython's 5 ms waits for the GIL
logger = logging.getLogger(__name__)
LIMIT_S = 2.0  # a worker stuck in a collective a peer never joins is left as it is
FALLBACK_S = 0.1
TASKS = "/proc/self/task"

WHY = "an atexit handler: gloo's worker threads finish with the GIL before the interpreter finalizes (SIGABRT)"


def drain_at_exit(backend: str) -> None:
    """Register the exit handler once per process, unless opted out, when gloo is in use: ``backend`` (the
    sharded group's, e.g. ``"gloo"``) or the default group's names it."""
    default = dist.get_backend() if dist.is_initialized() else ""
    if "gloo" in backend or "gloo" in default:
        install_once("exit_drain", WHY, lambda: atexit.register(drain_gloo_workers))


def gloo_workers() -> dict[str, tuple[str, int]] | None:
    """``{thread id: (state, context switches)}`` of this process's gloo worker threads; ``None``
    without ``/proc``."""
    try:
        threads = os.listdir(TASKS)
    except OSError:
        return None
    found = {}
    for tid in threads:
        try:
            with open(f"{TASKS}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended
            continue
        if fields.get("Name", "").strip() != WORKER_NAME:
            continue
        switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        found[tid] = (fields["State"].split()[0], switches)
    return found


def drain_gloo_workers(limit_s: float = LIMIT_S) -> bool:
    """Release the GIL until gloo's worker threads are all still; ``True`` once they are (or none exist)."""
    before = gloo_workers()
    if before is None:  # registered only where gloo is in use
        time.sleep(FALLBACK_S)
        return False
    deadline = time.monotonic() + limit_s
    while before:
        time.sleep(STILL_S)  # the GIL released: a worker waiting for it takes it now
        after = gloo_workers() or {}
        if all(state != "R" and before.get(tid) == (state, switches) for tid, (state, switches) in after.items()):
            return True
        if time.monotonic() >= deadline:
            logger.debug("at exit: gloo worker threads still busy after %.1f s; left to the interpreter", limit_s)
            return False
        before = after
    return True
