"""A checkpoint is data, never code (issue 38): loading refuses anything that would run.

Each crafted checkpoint below carries a payload that, if unpickled, creates a marker file (the
stand-in for a shell command). Checksums are rewritten to match, as whoever crafts a file can:
the integrity check passes and only the allowlist stands between the file and the code. Every
rank must raise ``CheckpointError`` naming the file and what it tried to load, and no marker may
ever appear.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdp_compose import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_compose.extras.checkpoint import integrity
from fsdp_compose.extras.checkpoint.keys import flatten
from fsdp_compose.extras.checkpoint.safety import load_plain, not_plain
from fsdp_compose.extras.checkpoint.save_load import _state
from tests.harness import run_on_ranks
from tests.models import max_abs_diff
from tests.extras.checkpoint.test_save_load import _full_params, _setup, _train


class Payload:
    """Unpickling this touches ``marker``: what ``os.system`` or any other call could do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _refused(fn) -> str:
    try:
        fn()
    except CheckpointError as error:
        return str(error)
    return "loaded"


def _rewrite_checksums(path: Path) -> None:
    """What a crafter does after replacing a file: record the new files' sizes and CRCs (collective)."""
    dist.barrier()
    manifest = integrity.record_checksums(path)
    if dist.get_rank() == 0:
        integrity.write_manifest(path, manifest)
    dist.barrier()


def _crafted(root: str) -> dict:
    """Three crafted checkpoints, each loaded on every rank; whether any payload ran."""
    rank = dist.get_rank()
    marker = Path(root, "payload-ran")
    model, opt = _setup()
    _train(model, opt, range(1))
    out = {}

    # 1. extra holding an object whose unpickling runs code: refused when saving
    out["save"] = _refused(lambda: save_checkpoint(Path(root, "a"), model, opt, extra={"loader": Payload(marker)}))

    # 2. a plain checkpoint whose .metadata is replaced by a payload, checksums rewritten
    path = Path(root, "metadata")
    save_checkpoint(path, model, opt, step=1)
    dist.barrier()
    if rank == 0:
        (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    out["metadata"] = _reload(path, marker)

    # 3. a value DCP reads as bytes (meta.step) holding a payload, written as DCP writes it
    path = Path(root, "value")
    flat = flatten(_state(model, opt))
    flat["meta.step"] = Payload(marker)
    flat["meta.extra"] = b"PK"
    dcp.save(flat, checkpoint_id=path)
    out["value"] = _reload(path, marker)

    # 4. an older checkpoint's pickled extra: refused unless knowingly allowed
    path = Path(root, "old")
    flat["meta.step"], flat["meta.extra"] = 7, pickle.dumps(Payload(marker))
    dcp.save(flat, checkpoint_id=path)
    out["old"] = _reload(path, marker)
    out["ran"] = marker.exists()
    return out


def _reload(path: Path, marker: Path) -> str:
    _rewrite_checksums(path)
    fresh, fresh_opt = _setup(seed=5)
    message = _refused(lambda: load_checkpoint(path, fresh, fresh_opt))
    dist.barrier()
    assert not marker.exists(), f"{path.name}: the payload ran"
    return message


def test_crafted_checkpoints_are_refused_before_anything_runs(tmp_path):
    for rank, out in enumerate(run_on_ranks(2, _crafted, str(tmp_path))):
        assert not out["ran"], rank
        assert "extra['loader']: a tests.extras.checkpoint.test_safety.Payload" in out["save"], out["save"]
        assert f"checkpoint file '{tmp_path}/metadata/.metadata' asks to load pathlib.Path" in out["metadata"], out
        assert "checkpoint value 'meta.step' in file '__" in out["value"], out["value"]
        assert "asks to load getattr" in out["value"], out["value"]  # torch.save reaches Path.touch via getattr
        assert "stores extra as a pickle" in out["old"] and "allow_pickled_extra=True" in out["old"], out["old"]


def _old_extra_opt_in(root: str) -> tuple:
    model, opt = _setup()
    _train(model, opt, range(1))
    path = Path(root, "old")
    flat = flatten(_state(model, opt))
    flat["meta.step"], flat["meta.extra"] = 3, pickle.dumps({"epoch": 2})
    dcp.save(flat, checkpoint_id=path)
    _rewrite_checksums(path)
    fresh, fresh_opt = _setup(seed=5)
    step, extra = load_checkpoint(path, fresh, fresh_opt, allow_pickled_extra=True)
    worst = max(max_abs_diff(a, b) for a, b in zip(_full_params(fresh).values(), _full_params(model).values()))
    return step, extra, worst


def test_an_older_pickled_extra_loads_when_allowed(tmp_path):
    for step, extra, worst in run_on_ranks(2, _old_extra_opt_in, str(tmp_path)):
        assert (step, extra, worst) == (3, {"epoch": 2}, 0.0)


def _plain_extra_and_torch_dcp(root: str) -> dict:
    model, opt = _setup()
    _train(model, opt, range(2))
    extra = {"epoch": 3, "lrs": [0.1, 0.01], "rng": torch.arange(4), "none": None, "pair": (1, "a")}
    save_checkpoint(Path(root, "ours"), model, opt, step=2, extra=extra)
    fresh, fresh_opt = _setup(seed=5)
    step, got = load_checkpoint(Path(root, "ours"), fresh, fresh_opt)
    out = {"step": step, "extra_equal": got.keys() == extra.keys() and torch.equal(got.pop("rng"), extra["rng"])}
    out["extra"] = got
    # torch's own DCP checkpoint of the same state: loads through the same allowlist, as step 0
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=Path(root, "torch"))
    fresh, fresh_opt = _setup(seed=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["torch_dcp"] = load_checkpoint(Path(root, "torch"), fresh, fresh_opt)
    out["warned"] = any("no checksums.json" in str(w.message) for w in caught)
    out["torch_dcp_diff"] = max(
        max_abs_diff(a, b) for a, b in zip(_full_params(fresh).values(), _full_params(model).values())
    )
    return out


def test_plain_extra_and_torch_dcp_checkpoints_load(tmp_path):
    for out in run_on_ranks(2, _plain_extra_and_torch_dcp, str(tmp_path)):
        assert out["step"] == 2 and out["extra_equal"], out
        assert out["extra"] == {"epoch": 3, "lrs": [0.1, 0.01], "none": None, "pair": (1, "a")}, out
        assert out["torch_dcp"] == (0, None) and out["warned"] and out["torch_dcp_diff"] == 0.0, out


def test_not_plain_names_the_place():
    assert not_plain({"a": [1, 2.0, "x", None, (True, b"y")], 3: torch.zeros(2), "d": torch.float32}) is None
    assert not_plain({"a": [1, {"b": object()}]}) == "extra['a'][1]['b']: a builtins.object"
    assert not_plain({"a": {1, 2}}) == "extra['a']: a builtins.set"
    assert not_plain(lambda: 0).startswith("extra: a builtins.function")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the bare pickle's protocol, which torch notes
def test_load_plain_refuses_a_payload(tmp_path):
    marker = tmp_path / "ran"
    saved = io.BytesIO()
    torch.save({"x": Payload(str(marker))}, saved)  # how DCP stores a value
    with pytest.raises(CheckpointError) as info:
        load_plain(saved.getvalue(), "'x'")
    assert "asks to load getattr" in str(info.value), info.value  # torch.save reaches Path.touch through it
    with pytest.raises(CheckpointError) as info:  # a bare pickle of it: refused too, before it runs
        load_plain(pickle.dumps({"x": Payload(str(marker))}), "'x'")
    assert os.listdir(tmp_path) == []
