"""Hugging Face safetensors checkpoints read straight into shards and written straight out of them.

``load_pretrained`` reads only each rank's rows; ``save_pretrained`` writes each rank's rows at their byte
offsets. Files are read through the checkpoint package's file layer (``extras/checkpoint/files.py``), and the
safetensors header parsed here (``safetensors_file.py``) from the descriptor it checked; saves go through a
fresh directory swapped into place (``save_dir.py``).
"""

from .load import LoadResult, load_pretrained
from .safetensors_file import PretrainedCheckpointError
from .save import save_pretrained

__all__ = ["load_pretrained", "save_pretrained", "LoadResult", "PretrainedCheckpointError"]
