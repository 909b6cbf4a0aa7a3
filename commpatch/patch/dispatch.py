"""Python kernels on the way to torch's own kernels of dispatcher ops, installed and removed on demand.

Collectives issued from C++ (DDP's reducer, ``ProcessGroup`` methods) or from compiled code
(``torch.ops._c10d_functional.*`` called by inductor's generated code) never reach a Python
function commpatch could replace; they all reach the dispatcher. ``Kernels`` registers, for a few
ops, a Python kernel at the ``ADInplaceOrView`` key, where torch has a fallthrough for them (it
only skips to the next key): the kernel redispatches to the keys below (``op.redispatch``), which
is what the fallthrough does, so the op computes exactly what it computed before, and observes
the call only when the next key is a real backend (``CPU`` or an accelerator's). Tracing (fake tensors,
functionalization, ``make_fx``, dynamo, AOT autograd: the ``Python`` / ``Functionalize`` keys come
next) and meta tensors pass straight through. Inference tensors (``torch.inference_mode``) have no
``ADInplaceOrView`` key: their calls are not seen.

Why not the backend key with ``torch.library.get_kernel``: ``SafeKernelFunction.call_boxed`` keeps
the GIL during the collective, and gloo's worker thread needs it to free a finished work's tensors
while holding its queue lock, which the next collective's enqueue waits for: a deadlock (seen in
1 of 11 runs of a 2-rank test). ``redispatch`` releases the GIL like any op call from Python.

A registration is process-global and costs ~10-50 us to install (1 ms the first time), ~2-15 us
to remove, and ~10 us per call while installed (docs/decisions/hidden-collectives.md): callers install
one only while it is needed and remove it with ``remove()``; every registration still live at
interpreter exit is removed then (a Python kernel left registered at exit can abort the process).
"""

from __future__ import annotations

import atexit
import threading
import warnings

KEY = "ADInplaceOrView"
_LIVE: set = set()  # Kernels with registrations, for the exit clean-up
_lock = threading.Lock()


def real_backends() -> tuple:
    """The dispatch keys of devices whose calls are real collectives: CPU and every accelerator
    (CUDA, XPU, HPU, MTIA, PrivateUse1 devices, MPS); not Meta, not tracing keys."""
    import torch

    keys = torch._C.DispatchKey
    return tuple(
        getattr(keys, name)
        for name in ("CPU", "CUDA", "XPU", "HPU", "MTIA", "PrivateUse1", "MPS")
        if hasattr(keys, name)
    )


class Kernels:
    """A set of Python kernels in one op namespace; ``wrap`` adds one, ``remove`` drops them all."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lib = None

    @property
    def installed(self) -> bool:
        return self.lib is not None

    def wrap(self, name: str, make) -> None:
        """For op ``namespace::name`` (default overload): ``make(call)`` gives a function
        ``(keyset, *args, **kwargs)`` that runs the op with ``call(keyset, *args, **kwargs)`` and
        returns its result; it is called for real tensors only, with the keys below this one."""
        import torch

        op = getattr(getattr(torch.ops, self.namespace), name).default
        after = torch._C._after_ADInplaceOrView_keyset
        real = real_backends()
        redispatch = op._handle.redispatch_boxed  # what OpOverload.redispatch calls
        observe = make(redispatch)  # called with the keyset below this key

        def kernel(keyset, *args, **kwargs):
            below = keyset & after
            if below.highestPriorityTypeId() not in real:
                return redispatch(below, *args, **kwargs)
            return observe(below, *args, **kwargs)

        with _lock:
            if self.lib is None:
                self.lib = torch.library.Library(self.namespace, "IMPL")
                _LIVE.add(self)
            with warnings.catch_warnings():  # "Overriding a previously registered kernel"
                warnings.simplefilter("ignore")
                self.lib.impl(name, kernel, KEY, with_keyset=True)

    def remove(self) -> None:
        """Unregister every kernel of this set: torch's fallthrough is back in place."""
        with _lock:
            lib, self.lib = self.lib, None
            _LIVE.discard(self)
            if lib is not None:
                lib._destroy()


def _remove_all() -> None:
    for kernels in list(_LIVE):
        try:
            kernels.remove()
        except Exception:  # noqa: BLE001 - exit clean-up: nothing to report to
            pass


atexit.register(_remove_all)
