"""The one error every checkpoint refusal raises, naming the file, the key or the value."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model / optimizer it is loaded into."""
