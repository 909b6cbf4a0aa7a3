"""What the reader and the analyses keep in ``DataFrame.attrs``, shared instead of copied.

pandas deep-copies a frame's ``attrs`` in ``__finalize__`` after nearly every operation (a column
read, a filter, a groupby result): a dict of 1,024 ranks' clocks or of 50,000 groups' log ends,
copied tens of thousands of times, was most of a report's time (issue 33). The values put there
are written once, by the reader or the analysis that made them, and only read afterwards:
``shared`` wraps them in a dict or list whose copy is itself, so what pandas copies is a reference.
"""

from __future__ import annotations


class _Shared:
    """What ``copy.copy`` / ``copy.deepcopy`` return as is (read-only by convention)."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class SharedDict(_Shared, dict):
    __slots__ = ()


class SharedList(_Shared, list):
    __slots__ = ()


def shared(value):
    """``value`` (a dict, list or tuple; anything else as is) in a form pandas copies by reference."""
    if isinstance(value, dict):
        return SharedDict(value)
    if isinstance(value, (list, tuple)):
        return SharedList(value)
    return value


__all__ = ["SharedDict", "SharedList", "shared"]
