"""Framework integrations: what the ``torch.distributed`` wrappers cannot see by themselves.

- ``ddp``:        DDP's gradient buckets (a comm hook installed automatically, user hooks wrapped)
                  and the C++-issued constructor / bucket-rebuild collectives.
- ``functional``: functional collectives (DTensor, tensor parallel), timed to their lazy wait.
- ``modules``:    which nn.Module and which phase (forward / backward / optimizer) issued a call.
- ``fsdp``:       FSDP's all-gathers and gradient reductions attributed to the unit whose
                  parameters moved, in the phase they ran.
- ``coalescing``: ``_coalescing_manager``: one row for the coalesced collective that ran.
- ``steps``:      the step counter without code change (optimizer steps, else DDP / FSDP root forwards).
- ``compiled``:   collectives inside compiled graphs and functional collectives' autograd
                  formulas (``_c10d_functional`` ops, seen at the dispatcher).

The contract (``Integration``): each module defines one ``INTEGRATION`` naming what it patches
and which torch internals it relies on, with ``wanted(settings)``, ``apply(ctx)`` and
``remove(ctx)``. Patches go through ``ctx.patches`` (``patch.hooks.Patches``: restored by
identity), late imports through ``when_imported``, rows through ``record`` (``record.rows``: the
same writer as the wrapper's slow path). A new integration is a module here plus an entry in ``ALL``.
"""

from __future__ import annotations

from ..record import state as _runtime
from . import base, coalescing, compiled, ddp, fsdp, functional, modules, steps
from .base import Context, Integration, Needs  # noqa: F401 - the contract, for integrations and their readers

# in the order they are applied
ALL: tuple[Integration, ...] = (
    ddp.INTEGRATION,
    functional.INTEGRATION,
    modules.INTEGRATION,
    fsdp.INTEGRATION,
    coalescing.INTEGRATION,
    compiled.INTEGRATION,
    steps.INTEGRATION,
)


def apply(log, timing, settings: dict) -> Context:
    ctx = base.CURRENT = Context(log, timing, settings)
    for integration in ALL:
        if integration.wanted(settings):
            try:
                # what can be told now (modules imported already); the rest when they are imported
                gaps = base.missing(integration, load=False)
                if gaps and base.say_missing(integration, gaps):
                    continue
                ctx.integration = integration
                integration.apply(ctx)
            except Exception as exc:  # noqa: BLE001 - an integration never breaks enable()
                _runtime.fail(f"integrations.{integration.name}", exc)
            finally:
                ctx.integration = None
    base.never_compiled()
    return ctx


def remove(ctx: Context | None) -> None:
    base.CURRENT = None
    if ctx is None:
        return
    for integration in ALL:
        integration.remove(ctx)
    ctx.patches.restore()
