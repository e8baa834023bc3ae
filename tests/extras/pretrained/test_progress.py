"""load_pretrained / save_pretrained report what this rank did: the progress bar on rank 0 counts the bytes
rank 0 reads or writes (its rows, so its rate is right), ``progress=False`` shows none, and an INFO record on
the ``fsdp_compose`` logger gives each rank's bytes and time."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import fully_shard, load_pretrained, save_pretrained
from tests.harness import run_on_ranks

tqdm = pytest.importorskip("tqdm", reason="the progress bar is tqdm's; without tqdm there is none to count")
import tqdm.auto  # noqa: E402  (after the skip: tqdm is optional)


class _Recorder:
    """Stands in for tqdm: keeps each bar's total and what was counted."""

    bars: list[_Recorder] = []

    def __init__(self, total: int, **_: object) -> None:
        self.total, self.counted = total, 0
        _Recorder.bars.append(self)

    def update(self, n: int) -> None:
        self.counted += n

    def close(self) -> None:
        pass


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 8))  # 2.0 MiB of weights and biases
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _save_and_load(path: str) -> dict:
    logger, records, real = logging.getLogger("fsdp_compose"), _Records(), tqdm.auto.tqdm
    level, tqdm.auto.tqdm = logger.level, _Recorder
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        bars = {}
        save_pretrained(_model(), path)
        bars["save"] = [(bar.total, bar.counted) for bar in _Recorder.bars]
        _Recorder.bars.clear()
        save_pretrained(_model(), path, progress=False)
        bars["save, progress=False"] = len(_Recorder.bars)
        result = load_pretrained(_model(), path)
        bars["load"] = [(bar.total, bar.counted) for bar in _Recorder.bars]
        _Recorder.bars.clear()
        load_pretrained(_model(), path, progress=False)
        bars["load, progress=False"] = len(_Recorder.bars)
    finally:
        tqdm.auto.tqdm = real
        logger.removeHandler(records)
        logger.setLevel(level)
        _Recorder.bars.clear()
    return {"rank": dist.get_rank(), "bytes_read": result.bytes_read, "bars": bars, "log": records.messages}


def test_the_bar_counts_this_ranks_bytes_and_can_be_turned_off(tmp_path) -> None:
    whole = (512 * 1024 + 1024 + 1024 * 8 + 8) * 4
    rank0, rank1 = run_on_ranks(2, _save_and_load, str(tmp_path / "out"))
    assert rank0["bytes_read"] + rank1["bytes_read"] == whole and 0 < rank0["bytes_read"] < whole
    mine = rank0["bytes_read"]  # Shard(0) rows: the bytes a rank writes are the bytes it reads
    assert rank0["bars"] == {"save": [(mine, mine)], "save, progress=False": 0, "load": [(mine, mine)], "load, progress=False": 0}
    assert rank1["bars"] == {"save": [], "save, progress=False": 0, "load": [], "load, progress=False": 0}  # rank 0's only
    for report in (rank0, rank1):
        kinds = [message.split(":")[0] for message in report["log"]]
        assert kinds == ["save_pretrained", "save_pretrained", "load_pretrained", "load_pretrained"], report["log"]
        rank, mib = report["rank"], report["bytes_read"] / 2**20
        assert f"rank {rank} read {mib:.1f} MiB of their {whole / 2**20:.1f}" in report["log"][2], report["log"]
        assert f"rank {rank} wrote {mib:.1f} MiB (its rows, in place)" in report["log"][0], report["log"]
