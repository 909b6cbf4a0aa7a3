"""Collectives that run inside compiled graphs, and those functional collectives' autograd
formulas issue: the ``torch.ops._c10d_functional`` ops, seen at the dispatcher.

Compiled code (inductor's generated ``call()``, aot_eager's and dynamo's FX graphs) calls
``torch.ops._c10d_functional.all_reduce_.default(buf, 'sum', '0')`` and later
``wait_tensor.default(buf)`` directly; the C++ autograd formulas of ``all_gather_tensor_autograd``
& co. call the same ops. No Python function of ``torch.distributed`` runs, so commpatch registers
a Python kernel for each of these ops on the way to torch's kernel (``patch.dispatch.Kernels``,
at the ``ADInplaceOrView`` key, a fallthrough for them): torch's kernel runs with the same
arguments (bit-identical results; traced and fake calls pass straight through), and a row is
written per collective, timed from issue to the return of the ``wait_tensor`` on its result
(``wait_tensors`` on a coalesced one's, torch 2.15) (timing ``wait``); the thread's time inside
that wait is the row's ``wait_us`` (exposed time).

- Rows: ``compiled.<op>`` (source ``compiled``, api the op's name) for a call from compiled code
  (or any other direct call of the op); ``funcol.<op>`` when an autograd node other than a
  compiled graph's is running (a functional collective's backward formula). In-place and
  ``_out`` variants are recorded under their op.
- No double count: the functional-collective wrappers (``integrations.functional``) set
  ``LOCAL.python_call`` while torch's function runs; the kernels skip those calls.
- Installed only while needed: from the first torch.compile compilation while enabled (dynamo's
  compile-start callback), at ``enable()`` when this process has compiled a graph already, or at
  the first functional collective with an autograd formula while recording; removed at
  ``disable()``. Until then these ops run torch's kernels directly.
- A compiled graph's first call runs under AOT autograd's custom-op check (a TorchDispatchMode
  that calls ops past the kernels' key): its collectives are observed in that mode's
  ``__torch_dispatch__``, wrapped while the kernels are installed. Under a TorchDispatchMode of
  your own, compiled collectives are likewise called past that key and not recorded.
- Still unseen: CUDA graph replays (``mode="reduce-overhead"``, ``triton.cudagraphs``: a replay
  launches the captured kernels without dispatching any op) and code that never dispatches
  these ops (ahead-of-time compiled C++ calling the backend directly).
"""

from __future__ import annotations

import time

from ..data.schema import T_DEVICE, T_NONE, T_WAIT
from ..patch.dispatch import Kernels
from ..record import state as _runtime
from .base import Integration, Needs, Waits, device_start, error_row, marks, on_device, record, when_imported

_pc = time.perf_counter_ns

# _c10d_functional op -> (row op when compiled, row op in an autograd formula, tensor args are a list)
# Both row ops count S the same way: the input (all_gather: "xn", times the group size).
OPS = {
    "all_reduce": ("compiled.all_reduce", "funcol.all_reduce", False),
    "all_reduce_": ("compiled.all_reduce", "funcol.all_reduce", False),
    "all_reduce_coalesced": ("compiled.all_reduce_coalesced", "funcol.all_reduce_coalesced", True),
    "all_reduce_coalesced_": ("compiled.all_reduce_coalesced", "funcol.all_reduce_coalesced", True),
    "all_gather_into_tensor": ("compiled.all_gather_into_tensor", "funcol.all_gather", False),
    "all_gather_into_tensor_out": ("compiled.all_gather_into_tensor", "funcol.all_gather", False),
    "all_gather_into_tensor_coalesced": (
        "compiled.all_gather_into_tensor_coalesced",
        "funcol.all_gather_coalesced",
        True,
    ),
    "reduce_scatter_tensor": ("compiled.reduce_scatter_tensor", "funcol.reduce_scatter", False),
    "reduce_scatter_tensor_out": ("compiled.reduce_scatter_tensor", "funcol.reduce_scatter", False),
    "reduce_scatter_tensor_coalesced": (
        "compiled.reduce_scatter_tensor_coalesced",
        "funcol.reduce_scatter_coalesced",
        True,
    ),
    "all_to_all_single": ("compiled.all_to_all_single", "funcol.all_to_all_single", False),
    "broadcast": ("compiled.broadcast", "funcol.broadcast", False),
    "broadcast_": ("compiled.broadcast", "funcol.broadcast", False),
}
_KERNELS = Kernels("_c10d_functional")
_CTX: list = []  # the integration context while enabled (one at most)


def wanted(settings: dict) -> bool:
    return True


def apply(ctx) -> None:
    _CTX[:] = [ctx]
    when_imported("torch._dynamo", _watch_dynamo)


def remove(ctx) -> None:
    _CTX.clear()
    _KERNELS.remove()  # ctx.patches restores dynamo's callback runner


def _watch_dynamo(ctx, dynamo) -> None:
    """Install at once if this process compiled a graph already; else at the first compilation
    (dynamo's ``callback_handler.run_start_callbacks``, wrapped on the instance: a registered
    callback would not survive ``torch._dynamo.reset()``)."""
    from torch._dynamo.utils import counters

    if counters["stats"]["unique_graphs"]:
        ensure_installed()
        return
    ctx.patches.wrap(dynamo.callback_handler, "run_start_callbacks", _on_compile_start)


def _on_compile_start(orig):
    def run_start_callbacks(*args, **kwargs):
        ensure_installed()
        return orig(*args, **kwargs)

    return run_start_callbacks


def formulas_unsupported() -> str | None:
    """Why the kernels cannot be installed for eager autograd formulas on this torch (None when
    they can): on torch 2.4, a wait on a functional collective's result under autograd then fails
    with "A view was created in no_grad mode and is being modified inplace" (a job that runs
    without commpatch would not)."""
    import torch

    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
        return f"torch {torch.__version__}: commpatch's dispatcher kernels would break autograd's view checks there"
    return None


_SAID_FORMULAS: list = []


def ensure_installed(for_formulas: bool = False) -> None:
    """Put the kernels in place (once, while enabled); never raises. ``for_formulas``: asked by an
    eager functional collective with an autograd formula, not by a compilation."""
    if _KERNELS.installed or not _CTX:
        return
    if for_formulas:
        why = formulas_unsupported()
        if why is not None:
            if not _SAID_FORMULAS:
                _SAID_FORMULAS.append(why)
                import warnings

                warnings.warn(
                    f"commpatch: the collectives of functional collectives' backward formulas are not "
                    f"recorded on {why}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
    try:
        _install(_CTX[0])
    except Exception as exc:  # noqa: BLE001
        _KERNELS.remove()
        _runtime.fail("compiled.install", exc)


def _install(ctx) -> None:
    import torch

    log, timing = ctx.log, ctx.timing
    waits = Waits(log, timing)
    groups: dict = {}
    node = torch._C._current_autograd_node
    makers = {}  # OpOverload -> make(call), also for the first invocation below
    for name, (compiled_op, formula_op, many) in OPS.items():
        packet = getattr(torch.ops._c10d_functional, name, None)  # older torch lacks some (said at apply)
        if packet is not None:
            makers[packet.default] = lambda call, c=compiled_op, f=formula_op, m=many: _kernel(
                log, timing, call, c, f, m, waits, groups, node
            )
    makers[torch.ops._c10d_functional.wait_tensor.default] = lambda call: _wait_kernel(call, waits)
    many_waits = getattr(torch.ops._c10d_functional, "wait_tensors", None)  # torch 2.15: a coalesced result's
    if many_waits is not None:
        makers[many_waits.default] = lambda call: _wait_kernel(call, waits, many=True)
    for op, make in makers.items():
        _KERNELS.wrap(op._opname, make)
    try:
        from torch._functorch._aot_autograd import runtime_wrappers
    except ImportError:  # an older torch has no first-invocation mode
        return
    mode = getattr(runtime_wrappers, "_AnalyzeCustomOpInputOutputMode", None)
    if mode is not None:
        ctx.patches.wrap(mode, "__torch_dispatch__", lambda orig: _first_invocation(orig, makers))


def _first_invocation(orig, makers: dict):
    """AOT autograd runs a compiled graph's first call under a TorchDispatchMode (custom-op
    aliasing checks) whose ``func(*args)`` skips every key above the backend, the kernels' key
    included: that call's collectives are observed here, with the same row writers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        make = makers.get(func) if _KERNELS.installed else None
        if make is None or not all(type(a) is _tensor() for a in args if isinstance(a, _tensor())):
            return orig(self, func, types, args, kwargs)
        observe = make(lambda _keyset, *a, **k: orig(self, func, types, a, k))
        return observe(None, *args, **(kwargs or {}))

    return __torch_dispatch__


def _tensor():
    import torch

    return torch.Tensor


def _kernel(log, timing, call, compiled_op: str, formula_op: str, many: bool, waits: Waits, groups: dict, node):
    state, local = _runtime.STATE, _runtime.LOCAL

    def collective(keyset, *args, **kwargs):
        if not state.recording or local.python_call:
            return call(keyset, *args, **kwargs)
        try:
            first = args[0]
            numel = sum(t.numel() for t in first) if many else first.numel()
            tensor = first[0] if many else first
            running = node()
            op = formula_op if running is not None and "CompiledFunction" not in running.name() else compiled_op
            group = _group(groups, args[-1])
            peer = args[1] if op.endswith("broadcast") else -1
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("compiled.read", exc)
            return call(keyset, *args, **kwargs)
        started = device_start(timing, tensor, "compiled")
        start = _pc()
        try:
            result = call(keyset, *args, **kwargs)
        except BaseException:
            if started is not None:
                timing.cancel(started)
            error_row(log, op, group, tensor, numel, start, peer, "compiled")
            raise
        end = _pc()
        try:
            last = result[-1] if many else result
            # on an accelerator the host's times say nothing of the device's: timed there, or not at all
            code = T_WAIT if started is None and not on_device(tensor, log) else T_DEVICE if started else T_NONE
            seq = record(log, op, group, tensor, numel, start, end, True, code, peer=peer)
            if code != T_NONE:  # (a device that gives no events now, a capturing stream: untimed)
                waits.add(last.untyped_storage().data_ptr(), last, seq, start, started, log.group_ids.get(group, -1))
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("compiled.record", exc)
        return result

    return collective


def _wait_kernel(call, waits: Waits, many: bool = False):
    """``wait_tensor(tensor)``, or with ``many`` ``wait_tensors(tensors)`` (torch 2.15: what compiled
    code and funcol's backward formulas wait a coalesced collective's results with)."""

    def wait_tensor(keyset, tensor):
        stalls = marks(waits, tensor, many) if waits.devices else None
        began = _pc()  # the thread's wait (exposed time): one clock read
        out = call(keyset, tensor)
        if waits:
            try:
                for one in tensor if many else (tensor,):
                    key = one.untyped_storage().data_ptr()
                    waits.waited(key, began, stalls.get(key) if stalls else None)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("compiled.wait", exc)
        return out

    return wait_tensor


def _group(cache: dict, name):
    """The ProcessGroup named by an op's ``group_name`` argument (a name, or a boxed group)."""
    pg = cache.get(name) if isinstance(name, str) else None
    if pg is None or pg not in _world().pg_names:  # destroyed since: a new group may have its name
        from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

        pg = _resolve_process_group(name) if isinstance(name, str) else ProcessGroup.unbox(name)
        if isinstance(name, str):
            cache[name] = pg
    return pg


def _world():
    from torch.distributed.distributed_c10d import _world

    return _world


def _gaps() -> str | None:
    why = formulas_unsupported()
    return (
        f"the collectives of eager functional collectives' backward formulas are not recorded ({why})" if why else None
    )


INTEGRATION = Integration(
    name="compiled",
    gaps=_gaps,
    patches="Python kernels (torch.library, ADInplaceOrView key) on the way to torch's kernels of the "
    "_c10d_functional collectives and wait_tensor, while a compiled graph or a functional collective's "
    "autograd formula may issue them",
    relies_on=(
        Needs("torch.library.Library.impl"),
        Needs("torch._ops.OpOverload.redispatch"),
        Needs("torch._C._current_autograd_node"),
        Needs("torch._C._distributed_c10d._resolve_process_group"),
        Needs("torch._C._distributed_c10d.ProcessGroup.unbox"),
        Needs("torch.ops._c10d_functional.wait_tensor"),
        Needs(
            "torch._dynamo.callback_handler.run_start_callbacks",
            "collectives of graphs compiled after enable() (until a functional collective's autograd formula runs)",
        ),
        Needs("torch._dynamo.utils.counters", "collectives of graphs compiled before enable()"),
        # runtime_wrappers._AnalyzeCustomOpInputOutputMode (torch >= 2.5) is wrapped where it exists:
        # an older torch runs a graph's first call through the kernels like the others
        Needs("torch.ops._c10d_functional.all_reduce"),
    ),  # ops an older torch lacks: it issues none
    records="collectives inside compiled graphs and functional collectives' autograd formulas",
    wanted=wanted,
    apply=apply,
    remove=remove,
)
