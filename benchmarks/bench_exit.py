"""How often a finished run still fails at exit: N fresh runs of a script, counted.

    python benchmarks/bench_exit.py --runs 100                  # examples/train.py, 2 spawned ranks
    python benchmarks/bench_exit.py --flow torchrun --runs 50   # tests/scripts/exit_cleanly.py under torchrun
    python benchmarks/bench_exit.py --flow hf --runs 50 --torch # HF Trainer + save_model, torch's FSDP2
    python benchmarks/bench_exit.py --flow lightning --runs 50  # Lightning ModelParallelStrategy

gloo's worker thread sometimes drops the last reference to a finished ``Work`` while the interpreter
finalizes; freeing what it holds needs the GIL, and the process dies with SIGABRT ("terminate called
without an active exception") after a run that did all its work (docs/troubleshooting.md). The rate
depends on timing, so this only counts: each run is a fresh interpreter (nothing cheaper exercises
that exit), ``--parallel`` at a time, and a run fails if it exits non-zero or prints ``terminate
called``. ``--torch`` runs the same flow on torch's FSDP2 (for train.py: a copy of it with the
``fully_shard`` import swapped and ``explain``/``collective_bytes``, which need our groups, stubbed).
``--code DIR`` imports fsdp_compose from another checkout (e.g. main, for the numbers before a fix).
Prints one line per failure and a summary with the 1-minute load average seen.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TIMEOUT_S = 300

# train.py on torch's FSDP2: the fully_shard import swapped; what reads our groups stubbed
TORCH_IMPORTS = '''from torch.distributed.fsdp import fully_shard  # noqa: E402  (bench_exit.py --torch)

from types import SimpleNamespace  # noqa: E402

from fsdp_compose import checkpoint_exists, load_checkpoint, save_checkpoint  # noqa: E402


class _NoPlan:  # torch's FSDP2 has no plan: zeros
    totals = SimpleNamespace(params=0, param_bytes=0, groups=0, sent_per_step=0, predicted_peak_bytes=0)


def explain(model, optimizer=None):
    return _NoPlan()


def collective_bytes(model) -> int:
    return 0
'''


def torch_train_copy(directory: str) -> Path:
    """examples/train.py and gpt.py copied into ``directory``, train.py sharding with torch's FSDP2."""
    shutil.copy(ROOT / "examples" / "gpt.py", directory)
    text = (ROOT / "examples" / "train.py").read_text()
    swapped, found = re.subn(r"from fsdp_compose import \([^)]*\)\n", TORCH_IMPORTS, text)
    if found != 1:
        raise SystemExit("bench_exit.py: examples/train.py's fsdp_compose import changed; update TORCH_IMPORTS")
    path = Path(directory) / "train.py"
    path.write_text(swapped)
    return path


def command(flow: str, use_torch: bool, steps: int, scratch: str) -> list[str]:
    flag = ["--torch"] if use_torch else []
    if flow == "train":
        script = torch_train_copy(scratch) if use_torch else ROOT / "examples" / "train.py"
        return [sys.executable, str(script), "--steps", str(steps)]
    if flow == "spawn":
        return [sys.executable, str(SCRIPTS / "exit_cleanly.py"), *flag]
    if flow == "torchrun":
        return [*TORCHRUN, str(SCRIPTS / "exit_cleanly.py"), *flag]
    if flow == "hf":
        return [*TORCHRUN, str(SCRIPTS / "exit_after_hf_trainer.py"), *flag]
    if flow == "lightning":  # Lightning's own launcher; --reap waits for the rank it starts
        return [sys.executable, str(SCRIPTS / "exit_after_lightning.py"), "--reap", *flag]
    if flow == "shm":
        return [sys.executable, str(SCRIPTS / "exit_after_shm.py")]
    raise SystemExit(f"unknown flow {flow!r}")


def run_once(cmd: list[str], code: Path) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(code), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -signal.SIGKILL, f"timed out after {TIMEOUT_S} s\n{out}"
    return proc.returncode, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow", default="train", choices=["train", "spawn", "torchrun", "hf", "lightning", "shm"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--steps", type=int, default=20, help="train.py's --steps")
    parser.add_argument("--torch", action="store_true", help="torch's FSDP2 instead of fsdp_compose")
    parser.add_argument("--code", default=str(ROOT), help="the checkout fsdp_compose is imported from")
    args = parser.parse_args()
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_exit_") as scratch:
        cmd = command(args.flow, args.torch, args.steps, scratch)
        started = time.monotonic()

        def one(i: int) -> tuple[int, str]:
            loads.append(os.getloadavg()[0])
            return run_once(cmd, Path(args.code))

        failures = 0
        with ThreadPoolExecutor(args.parallel) as pool:
            for i, (rc, out) in enumerate(pool.map(one, range(args.runs))):
                if rc != 0 or "terminate called" in out:
                    failures += 1
                    lines = out.strip().splitlines()
                    causes = [ln for ln in lines if "terminate called" in ln or "Error" in ln or "Exception" in ln]
                    tail = " | ".join((causes[:2] + lines[-2:]) if causes else lines[-3:])[-600:]
                    print(f"run {i}: exit code {rc}: {tail}", flush=True)
    who = "torch's FSDP2" if args.torch else f"fsdp_compose ({args.code})"
    print(
        f"{args.flow}, {who}: {failures} of {args.runs} runs failed at exit; {args.parallel} at a time, "
        f"{time.monotonic() - started:.0f} s, 1-minute load average {min(loads):.1f} to {max(loads):.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
