"""A checkpoint reads only its own files (issue 48): nothing outside its directory, nothing unbounded.

One pool of ranks crafts each case as an attacker would (checksums forged to match wherever a
crafter could write them) and loads it on every rank: outside and absolute paths, symlinks to a file
and to ``/dev/zero``, a FIFO, a directory, forged manifests, compressed records, lying lengths and
numels, deep ``extra``, and the same against a checkpoint torch's ``dcp.save`` wrote. Each must be
refused on every rank with the same ``CheckpointError`` naming the file or the key, without an unbounded read;
an audit hook on ``open`` shows nothing outside the case's directory is opened; peak memory stays
under 64 MiB plus the checkpoint's size; the model is left untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
import time
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdp_compose import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_compose.extras.checkpoint import integrity
from fsdp_compose.extras.checkpoint.files import check_payload
from fsdp_compose.extras.checkpoint.reader import CheckedReader
from fsdp_compose.extras.checkpoint.safety import MAX_DEPTH, not_plain
from tests.harness import hang_timeout, run_on_ranks
from tests.extras.checkpoint.test_save_load import _full_params, _setup, _train

BOMB_BYTES = 256 << 20  # what a compressed record inflates to: far over the memory bound
LIE_BYTES = 2 << 30  # a length pointed at /dev/zero or past a file's end

_opened: list[str] | None = None  # paths opened while recording


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


def _deep(depth: int) -> list:
    """``depth + 1`` lists, each in the next."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# ----- crafting (rank 0, on a copy of a good checkpoint) ---------------------------------------
def _metadata(case: Path):
    return pickle.loads((case / ".metadata").read_bytes())  # our own file: trusted here


def _write_metadata(case: Path, metadata) -> None:
    (case / ".metadata").write_bytes(pickle.dumps(metadata))


def _point(case: Path, key: str, **fields) -> None:
    """Every storage entry of ``key`` changed as ``fields`` say (where it is stored, its bytes)."""
    metadata = _metadata(case)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == key:
            metadata.storage_data[index] = dataclasses.replace(info, **fields)
    _write_metadata(case, metadata)


def _entry(case: Path, key: str):
    return next(info for index, info in _metadata(case).storage_data.items() if index.fqn == key)


def _forge_manifest(case: Path, **extra_entries) -> None:
    """What a crafter does last: checksums of every regular file, plus any entries it likes."""
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": integrity.crc32_of(p)}
        for p in case.iterdir()
        if p.is_file() and not p.is_symlink() and p.name != integrity.MANIFEST
    }
    files.update(extra_entries)
    (case / integrity.MANIFEST).write_text(json.dumps({"algorithm": "crc32", "files": files}))


def _add_item(case: Path, key: str, name: str, payload: bytes) -> None:
    """A new file ``name`` holding ``payload``, and ``key``'s entry pointed at it."""
    (case / name).write_bytes(payload)
    _point(case, key, relative_path=name, offset=0, length=len(payload))


def _bomb_zip(records: dict[str, bytes] | None = None) -> bytes:
    """A zip like torch.save's, whose data.pkl is deflated: ~256 KiB inflating to 256 MiB."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w", force_zip64=True) as record:
            record.write(b"\x80\x02X" + BOMB_BYTES.to_bytes(4, "little"))  # one BINUNICODE string
            chunk = b"a" * (1 << 20)
            for _ in range(BOMB_BYTES >> 20):
                record.write(chunk)
            record.write(b".")
        for name, data in (records or {}).items():
            archive.writestr(name, data)
    return out.getvalue()


def _record_past_its_item(payload: bytes) -> bytes:
    """torch.save's zip with data.pkl's central-directory sizes (compressed, uncompressed) raised to 16 MiB."""
    data, name = bytearray(payload), b"archive/data.pkl"
    at = next(i for i in range(len(data)) if data[i : i + 4] == b"PK\x01\x02" and data[i + 46 : i + 62] == name)
    data[at + 20 : at + 28] = (16 << 20).to_bytes(4, "little") * 2
    return bytes(data)


def _saved(value) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _tensor_keys(case: Path) -> list[str]:
    return [k for k, md in _metadata(case).state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]


def _craft(root: Path, good: Path, other: Path, torch_dcp: Path) -> dict[str, tuple[Path, list[str]]]:
    """Each case's directory and what its refusal must name; the cases are built on rank 0."""
    cases: dict[str, tuple[Path, list[str]]] = {}
    outside = str(other / "__0_0.distcp")  # another job's shard, at the public layout

    def case(name: str, base: Path = good) -> Path:
        path = root / name
        shutil.copytree(base, path, symlinks=True)
        return path

    key = _tensor_keys(good)[0]  # a model tensor, stored in both ranks' files
    c = case("dotdot")
    _point(c, key, relative_path="../other/__0_0.distcp")
    _forge_manifest(c)
    cases["dotdot"] = (c, [f"key {key!r}", "'../other/__0_0.distcp'", "not a file name"])

    c = case("absolute")
    _point(c, key, relative_path=outside)
    _forge_manifest(c)
    cases["absolute"] = (c, [f"key {key!r}", repr(outside), "not a file name"])

    c = case("symlink-to-file")
    (c / "__0_0.distcp").unlink()
    (c / "__0_0.distcp").symlink_to(outside)
    _forge_manifest(c, **{"__0_0.distcp": {"bytes": os.path.getsize(outside), "crc32": integrity.crc32_of(Path(outside))}})
    cases["symlink-to-file"] = (c, [f"file '{c}/__0_0.distcp'", "a symbolic link"])

    c = case("symlink-to-dev-zero")
    (c / "zero").symlink_to("/dev/zero")
    _point(c, key, relative_path="zero", offset=0, length=LIE_BYTES)
    _forge_manifest(c, zero={"bytes": LIE_BYTES, "crc32": 0})
    cases["symlink-to-dev-zero"] = (c, [f"file '{c}/zero'", "a symbolic link"])

    c = case("fifo")
    os.mkfifo(c / "fifo")
    _point(c, key, relative_path="fifo", offset=0, length=16)
    _forge_manifest(c, fifo={"bytes": 16, "crc32": 0})
    cases["fifo"] = (c, [f"file '{c}/fifo'", "a FIFO"])

    c = case("directory")
    (c / "__1_0.distcp").unlink()
    (c / "__1_0.distcp").mkdir()
    cases["directory"] = (c, [f"file '{c}/__1_0.distcp'", "a directory"])

    c = case("manifest-names-outside")
    _forge_manifest(c, **{"../other/__0_0.distcp": {"bytes": 1, "crc32": 1}, "/dev/zero": {"bytes": 1, "crc32": 1}})
    cases["manifest-names-outside"] = (c, ["entry '../other/__0_0.distcp' of checksums.json", "entry '/dev/zero'"])

    c = case("manifest-symlink-to-dev-zero")
    (c / integrity.MANIFEST).unlink()
    (c / integrity.MANIFEST).symlink_to("/dev/zero")
    cases["manifest-symlink-to-dev-zero"] = (c, [f"file '{c}/checksums.json'", "a symbolic link"])

    c = case("manifest-fifo")
    (c / integrity.MANIFEST).unlink()
    os.mkfifo(c / integrity.MANIFEST)
    cases["manifest-fifo"] = (c, [f"file '{c}/checksums.json'", "a FIFO"])

    c = case("manifest-misses-a-file")
    shutil.copy(c / "__0_0.distcp", c / "copy.distcp")
    _point(c, key, relative_path="copy.distcp")
    _forge_manifest(c)
    manifest = json.loads((c / integrity.MANIFEST).read_text())
    del manifest["files"]["copy.distcp"]
    (c / integrity.MANIFEST).write_text(json.dumps(manifest))
    cases["manifest-misses-a-file"] = (c, [f"key {key!r}", "file 'copy.distcp' is not in checksums.json"])

    c = case("compressed-record")
    _add_item(c, "meta.step", "bomb.distcp", _bomb_zip())
    _forge_manifest(c)
    cases["compressed-record"] = (c, ["key 'meta.step'", f"file '{c}/bomb.distcp'", "is compressed"])

    c = case("compressed-extra")
    _add_item(c, "meta.extra", "bomb.distcp", _saved(_bomb_zip()))
    _forge_manifest(c)
    cases["compressed-extra"] = (c, ["'meta.extra' (extra)", "is compressed"])

    c = case("record-past-its-item")
    _add_item(c, "meta.step", "long.distcp", _record_past_its_item(_saved(7)))
    _forge_manifest(c)
    cases["record-past-its-item"] = (c, ["key 'meta.step'", f"file '{c}/long.distcp'", "beyond the item's"])

    c = case("length-past-the-end")
    _point(c, key, length=LIE_BYTES)
    _forge_manifest(c)
    cases["length-past-the-end"] = (c, [f"key {key!r}", f"+ {LIE_BYTES} of file '__", "which holds"])

    c = case("truncated-behind-forged-checksums")
    shard = c / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _forge_manifest(c)
    cases["truncated-behind-forged-checksums"] = (c, ["of file '__1_0.distcp', which holds"])

    c = case("numel-differs-from-chunk")
    first, second = _tensor_keys(c)[:2]
    target = _entry(c, second)
    _point(c, first, relative_path=target.relative_path, offset=target.offset, length=target.length)
    _forge_manifest(c)
    cases["numel-differs-from-chunk"] = (c, [f"key {first!r} in file '{c}/__", "where the metadata's chunk is"])

    c = case("zstd-transform")
    _point(c, key, transform_descriptors=["zstd"])
    _forge_manifest(c)
    cases["zstd-transform"] = (c, [f"key {key!r}", "stored through ['zstd']"])

    c = case("deep-extra")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        deep = _saved(_saved(_deep(5_000)))  # the value meta.extra stores: torch.save's zip of torch.save's zip
    finally:
        sys.setrecursionlimit(limit)
    _add_item(c, "meta.extra", "deep.distcp", deep)
    _forge_manifest(c)
    cases["deep-extra"] = (c, ["'meta.extra' (extra)", f"nested more than {MAX_DEPTH} deep"])

    # an OSError on one rank only (applied in _failing_on_rank_1): every rank reaches the same verdict
    c = case("unreadable-on-rank-1")
    cases["unreadable-on-rank-1"] = (c, [f"file '{c}/__0_0.distcp'", "unreadable (PermissionError"])
    c = case("io-error-on-rank-1")
    cases["io-error-on-rank-1"] = (c, ["rank 1: key '", f"in file '{c}/__", "unreadable (OSError"])

    # torch's own DCP checkpoint (no checksums): the same file checks
    c = case("torch-dcp-dotdot", torch_dcp)
    torch_key = _tensor_keys(c)[0]
    _point(c, torch_key, relative_path="../other/__0_0.distcp")
    cases["torch-dcp-dotdot"] = (c, [f"key {torch_key!r}", "'../other/__0_0.distcp'"])

    c = case("torch-dcp-dev-zero", torch_dcp)
    (c / "zero").symlink_to("/dev/zero")
    _point(c, torch_key, relative_path="zero", offset=0, length=LIE_BYTES)
    cases["torch-dcp-dev-zero"] = (c, [f"file '{c}/zero'", "a symbolic link"])

    c = case("torch-dcp-compressed", torch_dcp)
    bytes_key = next(k for k in _metadata(c).state_dict_metadata if k not in _tensor_keys(c))
    _add_item(c, bytes_key, "bomb.distcp", _bomb_zip())
    cases["torch-dcp-compressed"] = (c, [f"key {bytes_key!r}", "is compressed"])
    return cases


@contextlib.contextmanager
def _failing_on_rank_1(case: Path):
    """Rank 1 alone meets an OSError other than "missing": opening a file (the unreadable case) or
    reading an item (the I/O error case); the other ranks must not be left waiting for it."""
    if dist.get_rank() != 1 or case.name not in ("unreadable-on-rank-1", "io-error-on-rank-1"):
        yield
        return
    if case.name == "io-error-on-rank-1":
        with mock.patch.object(CheckedReader, "_read_item", side_effect=OSError(5, "Input/output error")):
            yield
        return
    real_open, denied = os.open, str(case / "__0_0.distcp")

    def open_unless_denied(path, *args, **kwargs):
        if os.fspath(path) == denied:
            raise PermissionError(13, "Permission denied", denied)
        return real_open(path, *args, **kwargs)

    with mock.patch.object(os, "open", open_unless_denied):
        yield


# ----- the worker -----------------------------------------------------------------------------
def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))


def _disk_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _crafted_cases(root: str) -> dict:
    global _opened
    root = Path(root)
    model, opt = _setup()
    _train(model, opt, range(1))
    good, other, torch_dcp = root / "good", root / "other", root / "torch"
    save_checkpoint(good, model, opt, step=1, extra={"epoch": 1})
    stranger, stranger_opt = _setup(seed=9)  # another job, its checkpoint beside ours
    save_checkpoint(other, stranger, stranger_opt, step=5)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=torch_dcp)
    out: dict = {}
    try:
        save_checkpoint(root / "deep-save", model, opt, extra={"nested": _deep(5_000)})
        out["deep-save"] = "saved"
    except CheckpointError as error:
        out["deep-save"] = str(error)

    dist.barrier()
    cases = _craft(root, good, other, torch_dcp) if dist.get_rank() == 0 else None
    listing = [cases]
    dist.broadcast_object_list(listing, src=0)
    cases = listing[0]

    fresh, fresh_opt = _setup(seed=5)
    before = _full_params(fresh)
    if not getattr(sys, "_checkpoint_files_hook", False):  # one hook per process: hooks cannot be removed
        sys.addaudithook(_audit)
        sys._checkpoint_files_hook = True
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # peak RSS from here
    baseline = _peak_rss()
    for name, (case, _) in cases.items():
        _opened = []
        start = time.perf_counter()
        try:
            with _failing_on_rank_1(case):
                load_checkpoint(case, fresh, fresh_opt)
            message = "loaded"
        except CheckpointError as error:
            message = str(error)
        seconds = time.perf_counter() - start
        opened, _opened = _opened, None
        dist.barrier()  # a rank left waiting would hang here, within the harness's timeout
        out[name] = {"message": message, "seconds": seconds, "opened": sorted(set(opened))}
    out["peak_growth"] = _peak_rss() - baseline
    out["largest_case"] = max(_disk_bytes(case) for case, _ in cases.values())
    out["expected"] = {name: needles for name, (_, needles) in cases.items()}
    out["dirs"] = {name: str(case) for name, (case, _) in cases.items()}
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(), _full_params(fresh).values()))
    return out


@pytest.mark.slow  # every crafted case loaded on 2 ranks
def test_crafted_checkpoints_read_only_their_own_files(tmp_path):
    results = run_on_ranks(2, _crafted_cases, str(tmp_path))
    first = results[0]
    if os.environ.get("SHOW_CASES"):
        for name in first["expected"]:
            print(f"{name}: {first[name]['seconds']:.2f}s opened {first[name]['opened']}\n  {first[name]['message']}")
        print("peak growth", first["peak_growth"], "largest case", first["largest_case"], first["deep-save"])
    for rank, out in enumerate(results):
        assert out["unchanged"], f"rank {rank}: a refused load changed the model"
        assert f"extra: containers nested more than {MAX_DEPTH} deep" in out["deep-save"], out["deep-save"]
        assert out["peak_growth"] < (64 << 20) + out["largest_case"], (rank, out["peak_growth"], out["largest_case"])
        for name, needles in out["expected"].items():
            case = out[name]
            assert case["message"] == first[name]["message"], (name, rank, case["message"], first[name]["message"])
            for needle in needles:
                assert needle in case["message"], (name, needle, case["message"])
            # a hang detector, not a timing: a refusal takes well under a second, an unbounded read
            # (/dev/zero, a lying length) never ends; 2 minutes tells them apart on any machine
            assert case["seconds"] < hang_timeout(120), (name, rank, case["seconds"])
            inside = out["dirs"][name] + "/"
            for path in case["opened"]:  # imports aside, only regular files of the case's own directory
                if path.endswith((".py", ".pyc", ".so")) and str(tmp_path) not in path:
                    continue
                assert path.startswith(inside), (name, path)
                assert Path(path).is_file() and not Path(path).is_symlink(), (name, path)


def test_not_plain_reports_any_depth_without_recursing():
    assert not_plain(_deep(MAX_DEPTH - 1)) is None  # MAX_DEPTH lists, one in the other
    assert not_plain(_deep(MAX_DEPTH)) == f"extra: containers nested more than {MAX_DEPTH} deep"
    assert not_plain({"a": _deep(50_000)}) == f"extra: containers nested more than {MAX_DEPTH} deep"


def test_check_payload_admits_torch_save_and_refuses_compressed_records():
    check_payload(_saved({"step": 3, "w": torch.arange(6.0)}), "'x'")
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02K\x03.")
    with pytest.raises(CheckpointError, match=r"^'x': record 'archive/data.pkl' is compressed \(method 8\)"):
        check_payload(deflated.getvalue(), "'x'")
    with pytest.raises(CheckpointError, match=r"^'x': not a torch.save archive"):
        check_payload(pickle.dumps(3), "'x'")
