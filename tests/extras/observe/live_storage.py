"""PLACEHOLDER until issue-predictor's tracker is merged (then this file is theirs): live tensor storage,
counted by the library's StorageTracker."""

from __future__ import annotations

from fsdp_compose.extras.observe.storage import StorageTracker


class LiveStorage(StorageTracker):
    @property
    def peak_bytes(self) -> int:
        return self.peak
