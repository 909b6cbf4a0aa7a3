"""One warning the first time torch.compile compiles code while commpatch is enabled.

Dynamo rewrites ``dist.*`` calls into functional collectives inside the graph, so the Python
wrappers never see them: compiled collectives are not recorded (a documented limit). Rather than
leave a silent gap, commpatch says so once per process. The hook is a start callback in dynamo's
own registry (``torch._dynamo.callback.callback_handler``): it runs once per frame compilation,
never on the run of compiled code, is added by ``Patcher.apply`` and removed by ``Patcher.remove``.
When dynamo is not imported yet, a post-import hook adds it on import (hooks are permanent:
it checks ``_wanted``).
"""

from __future__ import annotations

import sys
import warnings

from . import _runtime

MODULE = "torch._dynamo.callback"
MESSAGE = ("commpatch: torch.compile is compiling code while commpatch is enabled; collectives inside "
           "compiled regions run as functional collectives in the graph and are not recorded "
           "(said once; see docs/reliability.md)")

_said = False          # once per process
_wanted = False        # between install() and uninstall()
_registered = None     # the callback_handler our callback is registered with
_hooked = False


def _on_compile_start(*_args) -> None:
    """Dynamo's start callback (torch 2.4 passes nothing, newer ones a CallbackArgs)."""
    global _said
    if _said:
        return
    _said = True
    try:
        warnings.warn(MESSAGE, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - warnings turned into errors must not break compilation
        try:
            sys.stderr.write(MESSAGE + "\n")
        except Exception:  # noqa: BLE001
            pass


def install() -> None:
    global _wanted, _hooked
    _wanted = True
    if MODULE in sys.modules:
        _register(sys.modules[MODULE])
    elif not _hooked:
        import wrapt

        _hooked = True
        wrapt.register_post_import_hook(_on_import, MODULE)


def uninstall() -> None:
    global _wanted, _registered
    _wanted = False
    handler, _registered = _registered, None
    if handler is not None:
        try:
            handler.remove_start_callback(_on_compile_start)
        except ValueError:      # someone cleared dynamo's callbacks already
            pass


def _on_import(module) -> None:
    if _wanted:
        _register(module)


def _register(module) -> None:
    global _registered
    try:
        handler = module.callback_handler
        if _registered is None:
            handler.register_start_callback(_on_compile_start)
            _registered = handler
    except Exception as exc:  # noqa: BLE001 - an older or newer dynamo: no notice, nothing else lost
        _runtime.fail("compile_notice", exc, rows=0)
