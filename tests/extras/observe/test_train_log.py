"""examples/train.py prints the log the docs promise and writes a one-step trace with our labels."""

import json
import os
import runpy
import subprocess
import sys

import pytest

from tests.harness import hang_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(*args: str, rerun_on_profiler_abort: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)  # this checkout's fsdp_compose, whatever is installed
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), *args],
        capture_output=True, text=True, timeout=hang_timeout(), env=env,
    )
    finished = "terminate called without an active exception" in done.stderr and "saved checkpoint of step 2" in done.stdout
    if done.returncode != 0 and rerun_on_profiler_abort and finished:
        # torch's profiler on gloo aborts about 1 exit in 6, plain torch too (docs/troubleshooting.md): once
        # more, into fresh directories (the checkpoint would make it resume)
        return _run(*[f"{a}-rerun" if i and args[i - 1] in ("--checkpoint-dir", "--profile") else a
                      for i, a in enumerate(args)])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_training_log_and_profile(tmp_path):
    out = _run("--steps", "2", "--batch-size", "2", "--profile", str(tmp_path / "trace"),
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "1", rerun_on_profiler_abort=True)
    lines = out.splitlines()
    assert lines[0].startswith("2 ranks train a GPT of 867,072 parameters (3.3 MiB), sharded in 5 groups"), out
    assert lines[1].startswith("each step, each rank sends 4.8 MiB to the others"), out
    assert lines[2].startswith("predicted memory per rank: 10.7 MiB") and '"peak RSS" below' in lines[2], out
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(w in steps[0] for w in ("loss", "ms", "tok/s", "peak RSS")), out
    assert all(line.endswith("sent 4.8 MiB") and line.count("MiB") == 2 for line in steps), out  # measured = predicted
    assert "saved checkpoint of step 1" in out and "wrote a one-step trace of step 1" in out, out
    trace = tmp_path / ("trace-rerun" if (tmp_path / "trace-rerun").exists() else "trace")
    with open(trace / "trace_rank0.json") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"fsdp_compose::all_gather blocks.0", "fsdp_compose::reduce_scatter <root>"} <= names


def test_help_says_batch_size_is_per_rank(monkeypatch, capsys):
    """In this process, not a fresh one (2.5 s): the script's imports, torch and fsdp_compose, are here already."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts examples/ and the checkout first
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps to the terminal's width: not this one's
    script = runpy.run_path(os.path.join(ROOT, "examples", "train.py"))  # not as __main__: main() not called
    with pytest.raises(SystemExit) as exited:
        script["main"]()
    assert exited.value.code == 0
    assert "sequences per rank" in capsys.readouterr().out
