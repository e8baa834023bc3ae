"""benchmarks/gpu_check.py runs on the CPU (its CUDA-only rows skipped), so it cannot rot before a GPU is lent.
It runs with ``--stage``: the collectives staged through host memory, what a GPU run uses where gloo
lacks a collective for CUDA tensors, are the path no other test takes."""

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_check
from tests.harness import hang_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # every CPU row of the GPU check
def test_gpu_check_runs_on_cpu():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--quick", "--cpu", "--stage"],
        capture_output=True, text=True, timeout=hang_timeout(), cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for config in gpu_check.PARITY_CONFIGS:  # every parity row ran, on both libraries, and passed
        row = next(line for line in lines if line.startswith(f"parity {config}, 2 ranks (gloo, all-gather and "
                                                             "reduce-scatter staged through the host)"))
        assert row.endswith(" ok"), row
    assert any(line.startswith("parity fp32, 1 rank, gloo") and line.endswith(" ok") for line in lines)
    assert sum(line.startswith("step time, ") for line in lines) == 3, done.stdout
    assert lines[-1].startswith("9 rows, 0 failed"), done.stdout


def test_gloo_has_every_collective_for_cpu_tensors(single_rank_group):
    assert gpu_check.gloo_lacks(torch.device("cpu"), 1) == []


def test_parity_row_fails_on_a_wrong_or_missing_result():
    args = SimpleNamespace(cuda=False)
    good = {"loss": 1e-7, "grad": 2e-7, "param": 3e-7, "sharded": True, "staged_calls": 0}
    assert gpu_check.parity_row("fp32", "fp32", good, good, args).verdict == "ok"
    for wrong in ({"grad": 0.5}, {"param": math.inf}, {"loss": math.nan}, {"sharded": False}):
        verdict = gpu_check.parity_row("fp32", "fp32", {**good, **wrong}, good, args).verdict
        assert verdict.startswith("FAIL"), (wrong, verdict)
    staged = "fp32 (gloo, all-gather staged through the host)"
    assert gpu_check.parity_row(staged, "fp32", good, good, args).verdict.startswith("FAIL")  # staging never ran
    ran = {**good, "staged_calls": 24}
    assert gpu_check.parity_row(staged, "fp32", ran, ran, args).verdict == "ok"
    # bf16: judged against torch's FSDP2 on the same run, but never above twice its error
    assert gpu_check.parity_row("bf16", "bf16 mixed precision", {**good, "grad": 0.03}, {**good, "grad": 0.02},
                                args).verdict == "ok"
    assert gpu_check.parity_row("bf16", "bf16 mixed precision", {**good, "grad": 0.2}, {**good, "grad": 0.02},
                                args).verdict.startswith("FAIL")
