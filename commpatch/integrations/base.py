"""The integration contract (``Integration``), the context an integration gets, and its helpers:
``when_imported`` (with the current context), ``record`` (``record.rows``: the one row writer)
and ``Waits`` (rows timed to the wait on their result).

What an integration relies on in torch is declared as ``Needs``: dotted names resolved against the
installed torch (``resolve``), by a test on every torch of the CI matrix, by ``commpatch env``, and
at run time before anything is patched: a missing name makes the integration record less (or
nothing) and say so once, naming the torch version and what is not recorded."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

from ..data.schema import T_HOST
from ..patch.hooks import Patches
from ..patch.hooks import when_imported as _when_imported
from ..record import state as _runtime
from ..record.rows import on_device, record  # noqa: F401 - the row writer of every integration

CURRENT = None  # the Context between apply() and remove()
_ADAPTERS: dict = {}
_SKIPPED: set[str] = set()  # commpatch modules whose code dynamo never compiles as a frame (never_compiled)


@dataclass(frozen=True)
class Needs:
    """One torch name an integration relies on: a dotted path (modules, then attributes) that
    ``resolve`` finds in the installed torch. ``loses``: what is not recorded without it; empty
    when the integration cannot work at all without it."""

    name: str  # alternatives (torch moved it between versions) separated by "|"
    loses: str = ""

    @property
    def required(self) -> bool:
        return not self.loses

    @property
    def names(self) -> list[str]:
        return self.name.split("|")


@dataclass(frozen=True)
class Integration:
    """What one integration patches and relies on, and how it is switched on and off."""

    name: str
    patches: str  # what it replaces (for the docs and for a reader of a traceback)
    relies_on: tuple[Needs, ...]  # torch names it depends on (resolved by tests, `commpatch env` and apply)
    wanted: Callable[[dict], bool]
    apply: Callable[[Context], None]
    remove: Callable[[Context], None] = lambda ctx: None
    records: str = ""  # what its rows are, for the warning when it is unavailable
    # what it does not record on this torch although every name it relies on is there (None: nothing)
    gaps: Callable[[], str | None] = lambda: None


_MISSING = object()


def resolve(name: str, load: bool = True):
    """The object a dotted name stands for in the installed torch: the longest prefix that is a
    module, then attributes. With ``load=False`` a module not imported yet is not imported:
    ``_MISSING`` is returned for it (not known yet). Raises ``LookupError`` naming what is missing."""
    parts = name.split(".")
    obj, i = None, len(parts)
    while i > 0:
        modname = ".".join(parts[:i])
        obj = sys.modules.get(modname)
        if obj is None and load:
            try:
                obj = importlib.import_module(modname)
            except ModuleNotFoundError as exc:
                if exc.name is None or not modname.startswith(exc.name):
                    raise LookupError(f"{name}: importing {modname} failed: {exc}") from None
                obj = None
            except Exception as exc:  # noqa: BLE001 - a module that fails to import is missing
                raise LookupError(f"{name}: importing {modname} failed: {type(exc).__name__}: {exc}") from None
        if obj is not None:
            break
        i -= 1
    if obj is None:
        if not load:
            return _MISSING
        raise LookupError(f"no module {parts[0]}")
    for j, attr in enumerate(parts[i:], start=i):
        if not load and isinstance(obj, types.ModuleType) and attr not in vars(obj):
            if _initializing(obj) or _not_loaded(obj, attr):
                return _MISSING
        try:
            obj = getattr(obj, attr)
        except Exception:  # noqa: BLE001 - torch.ops namespaces raise AttributeError or RuntimeError
            raise LookupError(f"{'.'.join(parts[:j])} has no {attr}") from None
    return obj


def _initializing(module) -> bool:
    """``module`` is still executing (in ``sys.modules`` while its import runs): its attributes are
    not all there yet. ``commpatch run`` enables commpatch from a hook on torch.distributed's import,
    which runs inside ``import torch``, before ``torch.nn.Module`` or ``torch.ops`` exist."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _not_loaded(module, attr: str) -> bool:
    """``attr`` of ``module`` may exist but is not loaded yet: a submodule not imported (found on
    disk without importing it), or a name the module makes on first access (a module-level
    ``__getattr__``, as torch's own for ``torch._dynamo``: asking would import it)."""
    if "__getattr__" in vars(module):
        return True
    if not hasattr(module, "__path__"):
        return False
    try:
        return importlib.util.find_spec(f"{module.__name__}.{attr}") is not None
    except (ImportError, ValueError):
        return False


def missing(integration: Integration, load: bool = True, under: str = "") -> list[tuple[Needs, str]]:
    """The integration's needs the installed torch lacks, each with why; with ``load=False`` only
    what can be told without importing anything; with ``under``, only names in that module."""
    out = []
    for need in integration.relies_on:
        names = [n for n in need.names if not under or n == under or n.startswith(under + ".")]
        whys = []
        for name in names:
            try:
                resolve(name, load=load)
                break
            except LookupError as exc:
                whys.append(str(exc))
        else:
            if names:
                out.append((need, "; ".join(whys)))
    return out


def status(integration: Integration) -> tuple[str, str]:
    """('active' | 'partial' | 'unavailable', why) on the installed torch (imports what it names)."""
    gaps = missing(integration)
    known = integration.gaps()
    whys = [why for _, why in gaps] + ([known] if known else [])
    if not whys:
        return "active", ""
    state = "unavailable" if any(need.required for need, _ in gaps) else "partial"
    return state, "; ".join(whys)


_SAID: set = set()


def say_missing(integration: Integration, gaps: list) -> bool:
    """Warn once per integration and missing name what is not recorded on this torch; True when
    the integration cannot work at all (a required name is missing)."""
    import torch

    fatal = any(need.required for need, _ in gaps)
    for need, why in gaps:
        if (integration.name, need.name) in _SAID:
            continue
        _SAID.add((integration.name, need.name))
        lost = need.loses or integration.records or f"the {integration.name} integration's rows"
        warnings.warn(
            f"commpatch: torch {torch.__version__} has no {' or '.join(need.names)} ({why}): {lost} "
            f"{'are' if lost.endswith('s') else 'is'} not recorded",
            RuntimeWarning,
            stacklevel=2,
        )
    return fatal


class Context:
    """What an integration needs from the session: the log, the timing state, its patches."""

    def __init__(self, log, timing, settings: dict | None = None) -> None:
        self.log = log
        self.timing = timing
        self.settings = settings or {}
        self.patches = Patches()
        self.integration: Integration | None = None  # the one being applied


def when_imported(modname: str, fn) -> None:
    """Run ``fn(ctx, module)`` now if imported, and at every later import while an integration
    context is active (``patch.hooks.when_imported``, with the current context). The integration
    being applied is checked first for what it needs from that module: where a required name
    is missing, ``fn`` does not run (said once)."""
    integration = CURRENT.integration if CURRENT is not None else None
    adapter = _ADAPTERS.get((modname, fn))
    if adapter is None:

        def adapter(module):
            if CURRENT is None:
                return
            gaps = missing(integration, under=modname) if integration is not None else []
            if gaps and say_missing(integration, gaps):
                return
            fn(CURRENT, module)

        _ADAPTERS[(modname, fn)] = adapter
    _when_imported(modname, adapter, error_kind=f"integrations.import:{modname}")


class Waits:
    """Rows of functional collectives, timed from issue to the return of the ``wait_tensor`` on
    their result: keyed by the result's storage address, as torch's work registry is (waits on
    views of it count); an entry keeps its tensor alive, so the storage is not reused meanwhile.
    The time the thread spent inside that wait (the first on the result: later ones return at
    once) is noted on the row (``log.waits``: the ``wait_us`` column, the exposed time).

    On an accelerator the wait only makes the current stream wait (the host returns at once): an
    entry ``started`` at issue on the device (``Timing.device_start``) is timed on the device
    instead, from issue to the stream passing the wait, and its wait is the stream's stall there
    (``mark``, an event recorded before the wait, to the end event after it: ``Timing.device_waited``)."""

    MAX = 1 << 16  # results never waited for are dropped beyond this

    def __init__(self, log, timing=None) -> None:
        self.pending: dict[int, tuple] = {}
        self.done = log.done
        self.waits = log.waits
        self.timing = timing
        self.devices = 0  # device entries pending: a wait marks the stream before it waits
        # storage address -> storage, of every result recorded and still alive (served())
        self.results = weakref.WeakValueDictionary()

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, key: int, tensor, seq: int, start: int, started=None, gid: int = -1) -> None:
        """The row ``seq`` (issued at ``start``, perf ns) waits for the wait on its result at
        ``key``; ``started``: its device measurement (on an accelerator), with its group id."""
        if len(self.pending) >= self.MAX:
            self.pending.clear()
            self.devices = 0
        if started is not None or self.devices:  # (CPU rows only: nothing to count)
            old = self.pending.get(key)
            self.devices += (started is not None) - (old is not None and old[3] is not None)
        self.pending[key] = (tensor, seq, start, started, gid)
        self.keep(key, tensor)

    def keep(self, key: int, tensor) -> None:
        """Remember a recorded result (its storage, weakly) for ``served``."""
        try:
            self.results[key] = tensor.untyped_storage()
        except TypeError:  # a storage without weak references (an older torch): not kept
            pass

    def served(self, key: int) -> bool:
        """An out-of-place collective's result at ``key`` is a result recorded before, still alive:
        handed back from a cache, no collective ran (activation checkpointing that saves collective
        outputs, torchtitan's SAC: its recomputation returns the saved output). A collective that
        runs writes a new buffer, which cannot share the storage of a live one."""
        return bool(key) and self.results.get(key) is not None

    def mark(self, key: int):
        """Before the wait on the result at ``key``: for a result timed on the device, an event on
        the current stream where its stall begins (``Timing.device_mark``); else None."""
        entry = self.pending.get(key)
        if entry is None or entry[3] is None:
            return None
        return self.timing.device_mark(entry[3])

    def waited(self, key: int, began: int, mark=None) -> None:
        """The wait on the result at ``key``, entered at ``began`` (perf ns), has returned
        (``mark``: ``mark(key)``'s event, for a result timed on the device)."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return
        if entry[3] is not None:
            self.devices -= 1
            try:
                self.timing.device_waited(entry[1], entry[4], entry[3], mark)
            except Exception as exc:  # noqa: BLE001 - device events unusable: the row stays untimed
                _runtime.fail("funcol.device_wait", exc)
            return
        now = time.perf_counter_ns()
        self.done[entry[1]] = now - entry[2]
        self.waits.append((entry[1], now - began))


def device_start(timing, tensor, kind: str):
    """A device measurement started at a functional collective's issue (``Timing.device_start``)
    when ``tensor`` lives on an accelerator, else None (never raises: device events unusable, the
    row is left untimed)."""
    if timing is None or tensor.is_cpu or tensor.is_meta:
        return None
    try:
        return timing.device_start(tensor)
    except Exception as exc:  # noqa: BLE001
        _runtime.fail(f"{kind}.timing", exc)
        return None


def storage_key(tensor):
    """Address of a tensor's storage, or None for one without real storage (fake, simulated)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - "invalid python storage" and the like
        return None


def marks(waits: Waits, tensor, many: bool) -> dict:
    """Before a wait on ``tensor`` (``many``: a list of them): {storage key: ``Waits.mark``'s event}
    for those whose collective is timed on the device (never raises)."""
    out = {}
    try:
        for one in tensor if many else (tensor,):
            key = storage_key(one)
            ev = waits.mark(key) if key is not None else None
            if ev is not None:
                out[key] = ev
    except Exception as exc:  # noqa: BLE001
        _runtime.fail("funcol.wait_mark", exc)
    return out


def error_row(log, op: str, group, tensor, numel: int, start: int, peer: int, kind: str) -> None:
    """The row of an async call torch raised from (timed on the host to the raise); never raises."""
    try:
        record(log, op, group, tensor, numel, start, time.perf_counter_ns(), True, T_HOST, err=True, peer=peer)
    except Exception as exc:  # noqa: BLE001
        _runtime.fail(f"{kind}.record", exc)


def invisible_to_dynamo(wrapper, orig):
    """Return ``wrapper`` (a Python function calling ``orig``) made invisible to dynamo: where
    dynamo inlines it into a graph it traces ``orig`` instead (``_torchdynamo_inline``, as for
    torch.compile's own wrappers), and no frame of commpatch is compiled (``never_compiled``)."""
    wrapper._torchdynamo_inline = orig
    never_compiled()
    return wrapper


def never_compiled() -> None:
    """Dynamo never compiles a frame of commpatch's code (``skip_code``: run as plain Python; the
    frames it calls, torch's or the user's, are still compiled as without commpatch). Without it,
    a frame of ours that runs while dynamo's frame callback is set (called from a compiled
    function after a graph break, or compiled itself: ``module.compile()`` compiles the modules
    wrapper) is traced, and with it what torch itself never traces there (FSDP2's
    dynamo-disabled hooks, issue 23)."""
    _when_imported("torch._dynamo", _skip_frames, error_kind="integrations.dynamo_skip")


def _skip_frames(dynamo) -> None:
    from torch._dynamo.eval_frame import skip_code

    for name, module in list(sys.modules.items()):
        if module is not None and name not in _SKIPPED and (name == "commpatch" or name.startswith("commpatch.")):
            _SKIPPED.add(name)
            for code in _codes(module, name):
                skip_code(code)


def _codes(module, name: str):
    """Every code object defined in a module: its functions', its classes' methods', nested ones."""
    todo = []
    for value in vars(module).values():
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            member = getattr(member, "__func__", member)  # staticmethod / classmethod
            for fn in (member.fget, member.fset) if isinstance(member, property) else (member,):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType) and getattr(fn, "__module__", None) == name:
                    todo.append(code)
    while todo:
        code = todo.pop()
        yield code
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
