"""Apply and remove the patches, driven by the target table only.

One wrapper object per function, installed in every namespace that holds the original
(``torch.distributed``, ``distributed_c10d``, modules that bound the name at import such as
``torch.distributed.tensor._collective_utils``, and user modules that did
``from torch.distributed import all_reduce`` before ``enable()``): torch compares these
functions by identity (``op.op is isend`` in ``batch_isend_irecv``). Removal restores the
recorded originals by identity from our own registry. Post-import hooks (wrapt) patch
modules imported later; they cannot be unregistered, so they check state and identity.
The integrations are applied by the session, after this (``commpatch.integrations``).
"""

from __future__ import annotations

import functools
import sys
import time

import wrapt

from ..data.ops import C10D, DIST, TARGETS
from ..record import state as _runtime
from ..record.wrapper import MARK, make_wrapper
from . import compile_notice as _compile_notice
from .hooks import Patches, when_imported

FUNCOL = "torch.distributed._functional_collectives"
_ALSO_IN = {t.name: t.also_in for t in TARGETS}


def _namespaces(name: str) -> tuple[str, ...]:
    return (C10D, DIST) + _ALSO_IN.get(name, ())


class Patcher:
    def __init__(self, log, timing, on_destroy=None) -> None:
        self.log = log
        self.timing = timing
        self.on_destroy = on_destroy  # called at destroy_process_group() of the default group
        self.originals: dict[str, object] = {}  # op name -> original function
        self.wrappers: dict[str, object] = {}  # op name -> the one wrapper object
        self.installed: list[tuple[object, str]] = []  # (module, attribute) we replaced
        self.remaps: list[object] = []  # wrappers added to dynamo's remap table
        self._hooked: set[str] = set()
        self.patches = Patches()  # Work.wait (_wrap_work_wait)

    @property
    def active(self) -> bool:
        return bool(self.wrappers)

    def apply(self, ops, host_only: bool) -> None:
        import torch.distributed.distributed_c10d as c10d

        for target in TARGETS:
            if ops is not None and target.name not in ops:
                continue
            orig = getattr(c10d, target.name, None)
            if orig is None:  # not in this torch version: skipped
                continue
            orig = getattr(orig, MARK, orig)  # already ours (e.g. a stale wrapper): use its original
            self.originals[target.name] = orig
            self.wrappers[target.name] = make_wrapper(target, orig, self.log, self.timing, host_only)
        self._wrap_lifecycle(c10d)
        self._wrap_work_wait()
        for name in self.wrappers:
            for modname in _namespaces(name):
                self._patch_module(modname, name)
                self._hook(modname)
        self._patch_user_modules()
        self._add_remaps()
        self._hook(FUNCOL)

    def remove(self) -> None:
        for mod, attr in reversed(self.installed):
            current = getattr(mod, attr, None)
            orig = getattr(current, MARK, None)
            if orig is not None:
                setattr(mod, attr, orig)
        self.installed.clear()
        self.patches.restore()
        self._remove_remaps()
        self.originals.clear()
        self.wrappers.clear()

    # ---- namespaces -------------------------------------------------------------
    def _patch_module(self, modname: str, attr: str) -> None:
        mod = sys.modules.get(modname)
        if mod is None or attr not in self.wrappers:
            return
        current = mod.__dict__.get(attr)
        if current is self.originals[attr]:
            wrapt.apply_patch(mod, attr, self.wrappers[attr])
            self.installed.append((mod, attr))
        elif current is self.wrappers[attr] and (mod, attr) not in self.installed:
            # imported while enabled: its own `from ... import` bound the wrapper; restore it too
            self.installed.append((mod, attr))

    def _hook(self, modname: str) -> None:
        """Patch ``modname`` whenever it is imported later (hooks are permanent: check state)."""
        if modname in self._hooked:
            return
        self._hooked.add(modname)

        def on_import(module, modname=modname):
            if not self.active:
                return
            if modname == FUNCOL:
                self._add_remaps()
            for attr in list(self.wrappers):
                self._patch_module(modname, attr)

        when_imported(modname, on_import, run_now=False, error_kind="patch.import_hook")

    def _patch_user_modules(self) -> None:
        """Catch ``from torch.distributed import all_reduce`` done before enable().

        Only attributes named like the function: a user's ``raw = dist.all_reduce`` (kept on
        purpose to call the unpatched function) is left alone.
        """
        for modname, mod in list(sys.modules.items()):
            if mod is None or modname.startswith(("torch.", "commpatch")) or modname == "torch":
                continue
            namespace = getattr(mod, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, orig in self.originals.items():
                if namespace.get(name) is orig:
                    wrapt.apply_patch(mod, name, self.wrappers[name])
                    self.installed.append((mod, name))

    # ---- torch.compile: keep dynamo's rewrite of dist.* into functional collectives ----
    def _add_remaps(self) -> None:
        """Our wrappers map to what their originals map to, in a table that notices the rewrite
        (``_compile_notice.RemapTable``), installed in place of torch's while enabled."""
        funcol = sys.modules.get(FUNCOL)
        remaps = getattr(funcol, "traceable_collective_remaps", None)
        if remaps is None:
            return
        if not isinstance(remaps, _compile_notice.RemapTable):
            remaps = _compile_notice.RemapTable(remaps, {})
            funcol.traceable_collective_remaps = remaps
        for name, wrapper in self.wrappers.items():
            orig = self.originals[name]
            if orig in remaps and wrapper not in remaps:
                remaps[wrapper] = remaps[orig]
                remaps.wrappers[wrapper] = name
                self.remaps.append(wrapper)

    def _remove_remaps(self) -> None:
        funcol = sys.modules.get(FUNCOL)
        remaps = getattr(funcol, "traceable_collective_remaps", None)
        if isinstance(remaps, _compile_notice.RemapTable):
            funcol.traceable_collective_remaps = remaps.original
        self.remaps.clear()

    # ---- async works without a future (gloo's send / recv): timed at the thread's wait ------
    def _wrap_work_wait(self) -> None:
        """``Work.wait`` stamps the row of a work ``Timing`` keeps for it (``Timing.waited``), or
        times the stall of the current stream in it for an async call on an accelerator
        (``Timing.wait_begin`` / ``wait_end``); any other work's wait is the original's, after two
        dict lookups."""
        work = getattr(sys.modules.get("torch._C._distributed_c10d"), "Work", None)
        if work is None:
            return
        timing, pc = self.timing, time.perf_counter_ns

        dev_waits = timing.dev_waits

        def make(orig):
            def wait(self, *args, **kwargs):
                if id(self) not in timing.at_wait:
                    if id(self) in dev_waits:  # an async call on an accelerator: the stream's stall
                        return _device_wait(self, orig, args, kwargs)
                    return orig(self, *args, **kwargs)
                began = pc()
                out = orig(self, *args, **kwargs)
                try:
                    timing.waited(self, began)
                except Exception as exc:  # noqa: BLE001 - the wait returned: the job goes on
                    _runtime.fail("work_wait", exc)
                return out

            wait._torchdynamo_inline = orig  # dynamo traces the original (integrations.base.invisible_to_dynamo)
            return wait

        def _device_wait(work, orig, args, kwargs):
            try:
                begun = timing.wait_begin(work)
            except Exception as exc:  # noqa: BLE001 - device events unusable: the wait is not timed
                _runtime.fail("work_wait", exc)
                begun = None
            out = orig(work, *args, **kwargs)
            if begun is not None:
                try:
                    timing.wait_end(begun)
                except Exception as exc:  # noqa: BLE001
                    _runtime.fail("work_wait", exc)
            return out

        self.patches.wrap(work, "wait", make)

    # ---- lifecycle: groups are forgotten and pending timings resolved on destroy ------
    def _wrap_lifecycle(self, c10d) -> None:
        orig = getattr(c10d, "destroy_process_group", None)
        if orig is None or hasattr(orig, MARK):
            return
        log, timing, on_destroy = self.log, self.timing, self.on_destroy

        def destroy_process_group(*args, **kwargs):
            try:
                timing.resolve(block=True)
                if not args and kwargs.get("group") is None and on_destroy is not None:
                    on_destroy()
                log.forget_groups()
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("destroy_process_group", exc)
            return orig(*args, **kwargs)

        functools.update_wrapper(destroy_process_group, orig)
        setattr(destroy_process_group, MARK, orig)
        self.originals["destroy_process_group"] = orig
        self.wrappers["destroy_process_group"] = destroy_process_group
