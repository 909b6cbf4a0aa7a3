"""Framework integrations: what the ``torch.distributed`` wrappers cannot see by themselves.

- ``ddp``:        DDP's gradient buckets (a comm hook installed automatically, user hooks wrapped)
                  and the C++-issued constructor / bucket-rebuild collectives.
- ``functional``: functional collectives (DTensor, tensor parallel), timed to their lazy wait.
- ``modules``:    which nn.Module and which phase (forward / backward / optimizer) issued a call.
- ``fsdp``:       FSDP's all-gathers and gradient reductions attributed to the unit whose
                  parameters moved, in the phase they ran.
- ``coalescing``: ``_coalescing_manager``: one row for the coalesced collective that ran.

Each integration exposes ``apply(ctx)`` / ``remove(ctx)``; ``Patcher.apply`` / ``remove`` call
the functions below. Patches go through ``Patches`` (restore by identity, like the core), and
rows go through ``record`` into the same ``Log`` with the same tuple layout as the wrapper's.
"""

from __future__ import annotations

import functools
import sys

import wrapt

from .. import _runtime
from .._log import F_ASYNC, F_CUDA, F_ERROR, T_SHIFT
from .._targets import OP_CODE
from .._wrapper import MARK, SEQ


class Patches:
    """Attributes replaced by integrations, restored by identity on remove."""

    def __init__(self) -> None:
        self.installed: list[tuple[object, str, object, object]] = []   # (owner, attr, orig, new)

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

CURRENT = None   # the Context between apply() and remove()
_HOOKED: set[tuple[str, object]] = set()


def when_imported(modname: str, fn) -> None:
    """Run ``fn(ctx, module)`` now if imported, and at every later import while active.

    wrapt's hooks are permanent and registered once: they look up the current context and do
    nothing without one. A later enable() (after a disable()) runs ``fn`` itself when the module
    is already imported: wrapt fires a hook at once only when it is registered.
    """
    def on_import(module):
        try:
            if CURRENT is not None:
                fn(CURRENT, module)
        except Exception as exc:  # noqa: BLE001
            _runtime.fail(f"integrations.import:{modname}", exc)

    if (modname, fn) not in _HOOKED:
        _HOOKED.add((modname, fn))
        wrapt.register_post_import_hook(on_import, modname)
        return
    module = sys.modules.get(modname)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        on_import(module)      # still importing: the registered hook runs at the end of it


class Context:
    """What an integration needs from the session: the log and the timing state."""

    def __init__(self, log, timing) -> None:
        self.log = log
        self.timing = timing
        self.patches = Patches()


def record(log, op: str, group, tensor, numel: int, start: int, end: int, async_op: bool,
           tcode: int, err: bool = False, peer: int = -1, seq: int | None = None) -> int:
    """Append one row (the wrapper's tuple layout) for a call an integration observed."""
    state = _runtime.STATE
    gid = log.group_ids.get(group)
    if gid is None:
        gid = log.group_id(group)
    if seq is None:
        seq = next(SEQ)
    cuda = tensor is not None and tensor.is_cuda     # the device column (and its backend) come from it
    flags = (async_op and F_ASYNC) | (cuda and F_CUDA) | (err and F_ERROR) | (tcode << T_SHIFT)
    log.rows.append((seq, OP_CODE[op], gid, tensor.dtype if tensor is not None else None, numel,
                     flags, start, end, peer, state.step, state.tag, state.where))
    return seq


def apply(log, timing, settings: dict) -> Context:
    global CURRENT
    from . import coalescing, ddp, fsdp, functional, modules

    ctx = CURRENT = Context(log, timing)
    for integration in (ddp, functional, modules, fsdp, coalescing):
        if integration.wanted(settings):
            try:
                integration.apply(ctx)
            except Exception as exc:  # noqa: BLE001 - an integration never breaks enable()
                _runtime.fail(f"integrations.{integration.__name__.rsplit('.', 1)[-1]}", exc)
    return ctx


def remove(ctx: Context | None) -> None:
    global CURRENT
    CURRENT = None
    if ctx is None:
        return
    from . import modules

    modules.remove(ctx)
    ctx.patches.restore()
