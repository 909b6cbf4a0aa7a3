"""The two patching primitives shared by the core patcher and every integration.

- ``Patches``: attributes replaced by identity and restored by identity (only if still ours).
- ``when_imported``: run a function now if a module is imported, and at every later import.

Both mark what they install with ``MARK`` (the original), so a stale wrapper is never wrapped twice.
"""

from __future__ import annotations

import functools
import sys

import wrapt

from ..record import state as _runtime
from ..record.wrapper import MARK

_HOOKED: set[tuple[str, object]] = set()


class Patches:
    """Attributes replaced by integrations, restored by identity on remove."""

    def __init__(self) -> None:
        self.installed: list[tuple[object, str, object, object]] = []  # (owner, attr, orig, new)

    def wrap(self, owner, attr: str, make) -> None:
        """Replace ``owner.attr`` with ``make(orig)`` unless it is already ours."""
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if orig is None or hasattr(orig, MARK):
            return
        new = make(orig)
        if not isinstance(new, staticmethod):
            try:
                functools.update_wrapper(new, orig)
            except (AttributeError, TypeError):
                pass
            setattr(new, MARK, orig)
        setattr(owner, attr, new)
        self.installed.append((owner, attr, orig, new))

    def restore(self) -> None:
        for owner, attr, orig, new in reversed(self.installed):
            current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
            if current is new:
                setattr(owner, attr, orig)
        self.installed.clear()


def when_imported(modname: str, fn, run_now: bool = True, error_kind: str = "") -> None:
    """Run ``fn(module)`` at every later import of ``modname`` and, with ``run_now``, now if it is
    imported already.

    wrapt's hooks are permanent: one is registered per (modname, fn) and ``fn`` itself checks
    whether it is still wanted. wrapt fires a hook at once only when it is registered, so a later
    call with the same ``fn`` (enable() after disable()) runs it itself when the module is there.
    """

    def on_import(module):
        try:
            fn(module)
        except Exception as exc:  # noqa: BLE001 - an import never fails because of us
            _runtime.fail(error_kind or f"patch.import:{modname}", exc)

    if (modname, fn) not in _HOOKED:
        _HOOKED.add((modname, fn))
        wrapt.register_post_import_hook(on_import, modname)
        return
    module = sys.modules.get(modname)
    if run_now and module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        on_import(module)  # still importing: the registered hook runs at the end of it
