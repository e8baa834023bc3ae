"""The text of the error a call raises, typed, for expecttest comparisons."""

import pytest


def message(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"
