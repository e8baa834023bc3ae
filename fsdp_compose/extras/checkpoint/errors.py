"""The one error every checkpoint refusal raises, naming the file, the key or the value."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model / optimizer it is loaded into."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there
