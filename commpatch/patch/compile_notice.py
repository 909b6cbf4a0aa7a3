"""One warning when a collective is compiled into a torch.compile graph while commpatch records.

Collectives inside compiled graphs run as ``torch.ops._c10d_functional.*`` calls from the
generated code, which no Python wrapper of commpatch sees: they are not recorded (a documented
limit). Rather than leave a silent gap, or warn for every compiled model (most compiled regions
hold no collective), commpatch says so once per process at the moment a collective is traced
into a graph, naming it:

- ``dist.*`` calls: dynamo rewrites them through ``traceable_collective_remaps``; commpatch's
  remap table (``RemapTable``) notices the lookup of one of its wrappers (a lookup, in real
  Python, made only while dynamo rewrites such a call).
- functional collectives (DTensor, tensor parallel): AOT autograd runs them as real Python on fake
  tensors while ``torch.compiler.is_compiling()`` is true; the functional-collective wrappers call
  ``collective_compiled`` then.
A functional collective that user code calls directly inside a compiled function is traced by
dynamo symbolically (no real Python runs): that case alone is not announced.
"""

from __future__ import annotations

import sys
import warnings

_said = False          # once per process

MESSAGE = ("commpatch: torch.compile traced the collective {name!r} into a compiled graph; collectives "
           "that run inside compiled code are not recorded by commpatch (said once; see README, "
           "'What commpatch cannot see')")


def collective_compiled(name: str) -> None:
    """Called (in real Python, during compilation) when a collective goes into a graph."""
    global _said
    if _said:
        return
    _said = True
    text = MESSAGE.format(name=name)
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - warnings turned into errors must not break compilation
        try:
            sys.stderr.write(text + "\n")
        except Exception:  # noqa: BLE001
            pass


class RemapTable(dict):
    """``torch.distributed._functional_collectives.traceable_collective_remaps`` while commpatch
    is enabled: the same mapping (with commpatch's wrappers added), which notices when dynamo
    rewrites one of the wrappers into a functional collective."""

    def __init__(self, original: dict, wrappers) -> None:
        super().__init__(original)
        self.original = original
        self.wrappers = wrappers       # name by wrapper, for the notice

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        name = self.wrappers.get(key)
        if name is not None:
            collective_compiled(name)
        return value
