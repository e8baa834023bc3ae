"""Atomic, verified, resharding checkpoints: ``save_checkpoint``, ``load_checkpoint`` and ``CheckpointError``.

``save_load.py`` saves and loads; ``keys.py`` names every value by a flat key and checks the
metadata against the model; ``integrity.py`` records and verifies per-file checksums;
``files.py`` lets a load read only the checkpoint's own regular files, within their sizes, and
``reader.py`` is DCP's storage reader built on it; ``safety.py`` reads the pickled pieces through
an allowlist.
"""

from .errors import CheckpointError
from .save_load import exists, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "exists", "load_checkpoint", "save_checkpoint"]
