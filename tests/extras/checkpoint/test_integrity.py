"""Checkpoint integrity: checksums, fallback, fault injection at every write point (issue 12, item 3).

torch's ``dcp.load`` (and FSDP2, which has no checkpoint layer of its own) loads a shard file
with a flipped byte silently; here every file's CRC-32 is verified first and every rank
raises ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from fsdp_compose import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_compose.extras.checkpoint import integrity
from fsdp_compose.extras.checkpoint import save_load as ckpt_module
from tests.harness import run_on_ranks
from tests.extras.checkpoint.test_save_load import _setup, _train

FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json"]
CORRUPTIONS = ["flip", "truncate", "delete"]


def _corrupt(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


def _on_rank0(fn) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _load(path, model, opt, **kwargs) -> str:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, _ = load_checkpoint(path, model, opt, **kwargs)
        return f"step {step}" + (" (fell back)" if caught else "")
    except CheckpointError as error:
        return str(error).splitlines()[-1].strip()


def _corrupted_files(root: str) -> dict:
    """Each kind of file, each kind of damage: refused by name; fallback=True loads the previous."""
    model, opt = _setup()
    path = Path(root, "ckpt")
    for step in (1, 2):
        _train(model, opt, range(step - 1, step))
        save_checkpoint(path, model, opt, step=step)
    fresh, fresh_opt = _setup(seed=5)
    out = {}
    for name in FILES:
        for how in CORRUPTIONS:
            case = Path(root, f"{name.strip('.')}-{how}")

            def prepare(case=case, name=name, how=how):
                shutil.copytree(path, case)
                shutil.copytree(path.with_name(".ckpt.previous"), case.with_name(f".{case.name}.previous"))
                _corrupt(case / name, how)

            _on_rank0(prepare)
            out[(name, how)] = (_load(case, fresh, fresh_opt), _load(case, fresh, fresh_opt, fallback=True))
    return out


def test_corrupt_files_are_refused_by_name_on_every_rank(tmp_path):
    results = run_on_ranks(2, _corrupted_files, str(tmp_path))
    assert results[0] == results[1]
    for (name, how), (refused, fell_back) in results[0].items():
        expected = {"delete": "missing", "truncate": "bytes, ", "flip": "checksum mismatch"}[how]
        if name == "checksums.json" and how != "delete":
            expected = "unreadable" if how == "truncate" else expected
        assert refused.startswith("file '") and f"/{name}':" in refused, (name, how, refused)
        if name != "checksums.json":
            assert expected in refused, (name, how, refused)
        assert fell_back == "step 1 (fell back)", (name, how, fell_back)


class Crash(Exception):
    """A save "dies" here: the disk is left as a crash at this point would leave it."""


def _then_crash(step):
    def run_then_crash(*args, **kwargs):
        step(*args, **kwargs)
        raise Crash

    return run_then_crash


def _crash_publishing_rename(rename):
    def rename_unless_publishing(self, target):
        if self.name.endswith(".partial"):
            raise Crash
        return rename(self, target)

    return rename_unless_publishing


# each write point of a save, and the step patched to die there (every one runs on rank 0)
CRASH_POINTS = {
    # the .partial directory exists and is claimed; nothing is written
    "prepared": lambda: mock.patch.object(integrity, "claim", _then_crash(integrity.claim)),
    # every rank's files are written; no checksums recorded
    "written": lambda: mock.patch.object(integrity, "write_manifest", side_effect=Crash),
    # the old checkpoint moved aside; the new one not yet in its place
    "between-renames": lambda: mock.patch.object(Path, "rename", _crash_publishing_rename(Path.rename)),
    # the new checkpoint in place; the previous one not yet removed
    "after-rename": lambda: mock.patch.object(ckpt_module, "_fsync_dir", _then_crash(ckpt_module._fsync_dir)),
}
DIED_WHILE = {
    "prepared": "preparing",
    "written": "recording checksums",
    "between-renames": "publishing",
    "after-rename": "publishing",
}


def _kill_at(root: str, point: str) -> dict:
    path = Path(root, point)
    model, opt = _setup()
    for step in (1, 2):
        save_checkpoint(path, model, opt, step=step)
    with CRASH_POINTS[point]():
        try:
            save_checkpoint(path, model, opt, step=3)
            died = "saved"
        except CheckpointError as error:
            died = str(error).split(":")[0]
    fresh, fresh_opt = _setup(seed=5)
    loaded = _load(path, fresh, fresh_opt)
    save_checkpoint(path, model, opt, step=4)  # cleans whatever the dead save left
    left = sorted(p.name for p in Path(root).iterdir() if point in p.name)
    return {"died": died, "loaded": loaded, "left": left, "after": _load(path, fresh, fresh_opt)}


def _faults(root: str) -> dict:
    out = {point: _kill_at(root, point) for point in CRASH_POINTS}
    # a .partial that a live process on this host owns is not deleted by another save
    path = Path(root, "owned")
    model, opt = _setup()

    def leave_owned_partial():
        partial = path.with_name(".owned.partial")
        partial.mkdir()
        (partial / "owner.json").write_text(json.dumps({"host": os.uname().nodename, "pid": os.getppid()}))

    _on_rank0(leave_owned_partial)
    try:
        save_checkpoint(path, model, opt, step=1)
        out["owned"] = "saved"
    except CheckpointError as error:
        out["owned"] = str(error).split(": ", 1)[1]
    return out


@pytest.mark.slow  # a save killed at each write point
def test_a_save_killed_at_each_write_point_leaves_a_loadable_checkpoint(tmp_path):
    results = run_on_ranks(2, _faults, str(tmp_path))
    assert results[0] == results[1]
    r = results[0]
    for point, loaded in [
        ("prepared", "step 2"),
        ("written", "step 2"),
        ("between-renames", "step 2"),
        ("after-rename", "step 3"),
    ]:
        assert r[point]["died"] == f"save_checkpoint failed while {DIED_WHILE[point]} on rank 0", r[point]
        assert r[point]["loaded"] == loaded, (point, r[point])
        assert r[point]["left"] == [f".{point}.previous", point], (point, r[point])  # no .partial left
        assert r[point]["after"] == "step 4"
    assert r["owned"].endswith(".owned.partial' belongs to a save still running"), r["owned"]


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))


def _huge_metadata(root: str) -> dict:
    """A 512 MiB sparse ``.metadata`` (torch's DCP layout: no checksums) is refused from its size, unread."""
    path = Path(root, "ckpt")
    model, opt = _setup()
    save_checkpoint(path, model, opt, step=1)

    def swell():
        (path / integrity.MANIFEST).unlink()
        os.truncate(path / ".metadata", 512 << 20)

    _on_rank0(swell)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # peak RSS from here
    baseline, start = _peak_rss(), time.perf_counter()
    message = _load(path, model, opt)
    return {"message": message, "seconds": time.perf_counter() - start, "growth": _peak_rss() - baseline}


def test_a_huge_metadata_file_is_refused_unread(tmp_path):
    """``.metadata`` was read whole with no limit (+600 MiB a rank for a sparse file): now its size is checked
    first (``files.METADATA_LIMIT``) and it is unpickled from the checked descriptor, never copied whole."""
    results = run_on_ranks(2, _huge_metadata, str(tmp_path), timeout=120)
    assert results[0]["message"] == results[1]["message"]
    for r in results:
        assert f"/ckpt/.metadata': {512 << 20} bytes, more than the {256 << 20}" in r["message"], r["message"]
        assert r["seconds"] < 10 and r["growth"] < (32 << 20), r
