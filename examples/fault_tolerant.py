"""Fault-tolerant HSDP on CPU with torchft: a replica group dies mid-backward, comes back, and catches up.

    pip install --no-deps torchft==0.2.0 opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    python examples/fault_tolerant.py                  # 2 replica groups x 2 gloo ranks, group 1 killed at step 4
    python examples/fault_tolerant.py --kill-at 0      # a healthy run

One command runs the whole recipe (docs/fault-tolerance.md): a torchft lighthouse, then two replica groups,
each a job of 2 ranks that shards a small model with ``fully_shard`` and averages gradients across the groups
through ``fsdp_compose.FaultTolerance``. At ``--kill-at K`` every rank of group 1 kills
itself with SIGKILL right after the first cross-replica all-reduce of step K's backward (a machine dying
mid-backward, with part of its gradients already averaged into group 0's); this script then starts group 1
again, which recovers the weights and optimizer state from group 0 and trains on. Training ends at the first
step >= ``--steps`` that every group commits together. It prints the steps each group committed, the attempts
thrown away, how long the recovery took, and whether both groups' final shards are bitwise equal.

Every process has a deadline (``--timeout``, then everything is killed) and is cleaned up on exit. Workers fork
from a server that already imported torch (as test harnesses do), so a restart here costs no interpreter start;
a real restart adds it (torch's import, ``init_process_group``, building the model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torchft
from torch import nn

from fsdp_compose import FaultTolerance, fully_shard

GROUPS, RANKS, WIDTH = 2, 2, 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(mesh=None, width: int = WIDTH) -> tuple[Net, torch.optim.Optimizer]:
    """The model every group builds (same seed: same initial weights), sharded, and its optimizer."""
    torch.manual_seed(0)
    model = Net(width)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data rank ``group * RANKS + rank``'s batch at ``step``: what plain HSDP's rank of that number reads."""
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def loss_of(model: nn.Module, data_rank: int, step: int) -> torch.Tensor:
    x, y = batch(data_rank, step)
    return nn.functional.mse_loss(model(x), y)


def shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards and optimizer state, as plain tensors."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    state = [{k: local(v) for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return {"params": {n: local(p).detach().clone() for n, p in model.named_parameters()}, "optim": state}


def digest(saved: dict) -> str:
    h = hashlib.sha256()
    for t in list(saved["params"].values()) + [v for s in saved["optim"] for v in s.values()]:
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----- one rank of one replica group ----------------------------------------------------------------------
def worker(group: int, rank: int, life: int, port: int, args: dict) -> None:
    out = Path(args["out"])
    log_file = os.open(out / f"worker.g{group}r{rank}.life{life}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log_file, 1)  # torchft's managers log every quorum: to a file per worker
    os.dup2(log_file, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    started = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, optimizer = build()
    ft = FaultTolerance(
        model,
        optimizer,
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=20)),
        replica_id=f"group{group}",
        lighthouse=args["lighthouse"],
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
    )
    built = time.time()
    if life == 0:  # every group's manager is up before the first quorum, so it holds them all
        (out / f"ready.g{group}r{rank}").touch()
        deadline = time.monotonic() + args["timeout"]
        while not (out / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the launcher never said go")
            time.sleep(0.05)
    kill_at, step, calls = args["kill_at"], 0, [0]
    if kill_at and group == 1 and life == 0:

        def hook(output: torch.Tensor) -> None:  # SIGKILL after step kill_at's first cross-replica all-reduce
            ft.all_reduce_hook(output)
            calls[0] += 1
            if step == kill_at and calls[0] == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        for module in model.modules():
            if hasattr(module, "set_all_reduce_hook"):
                module.set_all_reduce_hook(hook)
    log, path = [], out / f"log.g{group}r{rank}.life{life}.json"
    while True:
        step, calls[0] = ft.manager.current_step(), 0
        ft.optimizer.zero_grad()
        loss = loss_of(model, group * RANKS + rank, step)
        loss.backward()
        ft.optimizer.step()
        committed = ft.optimizer.committed
        log.append(
            dict(
                step=ft.manager.current_step() - 1 if committed else step,
                committed=committed,
                participating=ft.manager.is_participating(),
                participants=ft.manager.num_participants(),
                loss=loss.item(),
                t=time.time(),
            )
        )
        path.write_text(json.dumps(dict(started=started, built=built, log=log, digest=None, life=life)))
        done = ft.manager.current_step() >= args["steps"]
        everyone = log[-1]["participants"] == GROUPS or (out / "alone").exists()
        if (done and everyone and log[-1]["committed"]) or len(log) > args["steps"] + 200:
            break
        if args["step_time"]:
            time.sleep(args["step_time"])
    saved = shards(model, optimizer)
    torch.save(saved, out / f"final.g{group}r{rank}.pt")
    path.write_text(json.dumps(dict(started=started, built=built, log=log, digest=digest(saved), life=life)))
    ft.shutdown()
    dist.destroy_process_group()


# ----- the launcher: lighthouse, groups, the kill and the restart -----------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(out: Path, heartbeat_ms: int) -> tuple[subprocess.Popen, str]:
    # the console script beside this interpreter, run by it: the process we start is the lighthouse (a shim such
    # as pyenv's would leave it behind when killed)
    script = Path(sys.executable).parent / "torchft_lighthouse"
    cmd = [sys.executable, str(script)] if script.exists() else [shutil.which("torchft_lighthouse") or str(script)]
    cmd += ["--min_replicas", "1", "--bind", "[::]:0", "--quorum_tick_ms", "100", "--join_timeout_ms", "60000"]
    cmd += ["--heartbeat_timeout_ms", str(heartbeat_ms)]
    log = open(out / "lighthouse.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # in our process group: killed with it
    deadline = time.monotonic() + 300  # a hang detector: on a loaded machine its start (importing torch) took over 30 s
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"listening on: http://[^:\s]+:(\d+)", (out / "lighthouse.log").read_text())
        if found:
            return proc, f"http://localhost:{found.group(1)}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the lighthouse did not start:\n{(out / 'lighthouse.log').read_text()}")


def launch(args: argparse.Namespace) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="fault_tolerant_"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")  # children fork from a server that imported this file (torch, torchft)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    lighthouse, procs = None, {}
    began = time.monotonic()
    try:
        lighthouse, address = start_lighthouse(out, args.heartbeat_timeout_ms)
        options = dict(vars(args), out=str(out), lighthouse=address)
        restarts = {g: 0 for g in range(GROUPS)}

        def start(group: int, life: int) -> None:
            port = free_port()
            procs[group] = [ctx.Process(target=worker, args=(group, r, life, port, options)) for r in range(RANKS)]
            for p in procs[group]:
                p.start()

        for g in range(GROUPS):
            start(g, 0)
        port_retries = {g: 3 for g in range(GROUPS)}
        while len(list(out.glob("ready.*"))) < GROUPS * RANKS:
            check_deadline(began, args.timeout, procs)
            for g, ps in procs.items():
                if all(p.exitcode in (None, 0) for p in ps):
                    continue
                logs = "".join((out / f"worker.g{g}r{r}.life0.log").read_text() for r in range(RANKS))
                if "EADDRINUSE" not in logs or not port_retries[g]:  # a free port another process took first: again
                    raise RuntimeError(f"a worker of replica group {g} died before training began:\n{logs[-3000:]}")
                port_retries[g] -= 1
                for p in ps:
                    p.kill()
                    p.join()
                for ready in out.glob(f"ready.g{g}r*"):
                    ready.unlink()
                start(g, 0)
            time.sleep(0.05)
        (out / "go").touch()
        print(f"lighthouse at {address}; {GROUPS} replica groups x {RANKS} ranks training", clock(began))
        while any(p.exitcode is None for ps in procs.values() for p in ps):
            check_deadline(began, args.timeout, procs)
            for g, ps in procs.items():
                if any(p.exitcode not in (None, 0) for p in ps):
                    codes = [p.exitcode for p in ps]
                    stop(ps)
                    if restarts[g] < args.restarts:
                        print(f"replica group {g} died (exit codes {codes}); restarting it", clock(began))
                        restarts[g] += 1
                        start(g, restarts[g])
                    else:
                        print(f"replica group {g} failed (exit codes {codes}); the others train on", clock(began))
                        (out / "alone").touch()
                        procs[g] = []
            time.sleep(0.05)
        return report(out)
    finally:
        for ps in procs.values():
            stop(ps)
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()


def clock(began: float) -> str:
    return f"[{time.monotonic() - began:.1f} s]"


def check_deadline(began: float, timeout: float, procs: dict) -> None:
    if time.monotonic() - began > timeout:
        raise TimeoutError(f"the run took over {timeout:.0f} s; every process was killed")


def stop(ps: list) -> None:
    for p in ps:
        if p.exitcode is None:
            p.kill()
    for p in ps:
        p.join(timeout=10)


def ranges(steps: list[int]) -> str:
    parts, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(parts) or "none"


def report(out: Path) -> int:
    final = {}
    for g in range(GROUPS):
        for path in sorted(out.glob(f"log.g{g}r0.life*.json")):
            run = json.loads(path.read_text())
            log = run["log"]
            committed = [e["step"] for e in log if e["committed"]]
            alone = [e["step"] for e in log if e["committed"] and e["participating"] and e["participants"] < GROUPS]
            line = f"group {g} (start {run['life']}): committed steps {ranges(committed)}; alone {ranges(alone)}"
            for i, e in enumerate(log):
                if not e["committed"]:
                    before = next((b["t"] for b in reversed(log[:i]) if b["committed"]), run["built"])
                    after = next((a["t"] for a in log[i:] if a["committed"]), e["t"])
                    gap = after - before
                    line += f"; step {e['step']} thrown away once ({gap:.2f} s from the commit before it to the next)"
                elif not e["participating"]:
                    line += (
                        f"; recovered at step {e['step']}, {e['t'] - run['started']:.2f} s after its processes started "
                        f"({run['built'] - run['started']:.2f} s of it to join the job and build the model and manager)"
                    )
            print(line)
        final[g] = [json.loads(max(out.glob(f"log.g{g}r{r}.life*.json")).read_text())["digest"] for r in range(RANKS)]
    agree = None not in final[0] and all(final[g] == final[0] for g in final)
    print(f"final shards and optimizer state bitwise equal across replica groups: {agree}")
    print(f"logs and final shards in {out}")
    return 0 if agree else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="train until every group commits this step together")
    parser.add_argument("--kill-at", type=int, default=4, help="step at which group 1 dies mid-backward (0: never)")
    parser.add_argument("--restarts", type=int, default=1, help="how many times a dead group is started again")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to wait after each step")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="the lighthouse's")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before everything is killed")
    parser.add_argument("--out", help="where logs and final shards go (default: a new temporary directory)")
    args = parser.parse_args()
    sys.exit(launch(args))


if __name__ == "__main__":
    main()
