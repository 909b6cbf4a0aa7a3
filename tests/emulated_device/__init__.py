"""An emulated accelerator ("emu", torch's PrivateUse1) for testing device-side timing on CPU.

    from tests import emulated_device as emu
    emu.load()                                   # builds emudev.cpp once (cached), registers "emu"
    x = torch.ones(4, device="emu")              # host memory behind it; ops run via the CPU fallback
    start, end = torch.Event(device="emu", enable_timing=True), torch.Event(device="emu", enable_timing=True)
    start.record(); emu.sleep(x, 150); end.record()   # returns at once: the stream's worker sleeps
    end.synchronize(); start.elapsed_time(end)   # ~150 (ms), measured on the device's stream
    emu.host_waits()                             # host-side synchronizations so far (1)

Streams run their work in order on one worker thread each; events are stamped when the worker
reaches them. Aten ops execute on the calling thread after draining the current stream.
The build goes to ``$COMMPATCH_EMUDEV_CACHE`` (default ``~/.cache/commpatch-emudev``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import time
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "emudev.cpp")
BACKEND = "emu"
EXT_NAME = "commpatch_emudev"

_ext = None
build_seconds: float | None = None  # time the last load() spent in cpp_extension.load


def cache_dir() -> str:
    return os.environ.get("COMMPATCH_EMUDEV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "commpatch-emudev"
    )


def missing_toolchain() -> str | None:
    """Why the extension cannot be built here (None when it can)."""
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension will invoke
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH): the emulated device cannot be built"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "ninja is not installed: torch.utils.cpp_extension.load needs it"
    return None


def unsupported_torch() -> str | None:
    """Why the installed torch cannot host the emulated device (None when it can): it is driven
    through torch's device-generic API (``torch.accelerator``, ``torch.Event``, torch >= 2.6)."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "current_stream") or not hasattr(torch, "Event"):
        return (
            f"torch {torch.__version__} has no device-generic stream / event API (torch.accelerator, "
            "torch.Event: torch >= 2.6), which the emulated device is driven through; commpatch times "
            "CUDA there with torch.cuda.Event, and other accelerators not at all"
        )
    return None


def load(verbose: bool = False):
    """Build (first time) and import the extension, rename PrivateUse1 to "emu" and register
    ``torch.emu``. Idempotent; returns the extension module."""
    global _ext, build_seconds
    if _ext is not None:
        return _ext
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import torch
    import torch.distributed  # noqa: F401  (c10d's Backend must be registered before our subclass)
    from torch.utils import cpp_extension

    reason = missing_toolchain()
    if reason:
        raise RuntimeError(reason)
    build_dir = os.path.join(cache_dir(), f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")
    os.makedirs(build_dir, exist_ok=True)
    t0 = time.perf_counter()
    ext = cpp_extension.load(
        name=EXT_NAME,
        sources=[SOURCE],
        build_directory=build_dir,
        # no -std: torch's own flags name the standard its headers need (C++20 from 2.15)
        extra_cflags=["-O1"],
        verbose=verbose,
    )
    build_seconds = time.perf_counter() - t0
    if torch._C._get_privateuse1_backend_name() != BACKEND:
        torch.utils.rename_privateuse1_backend(BACKEND)
    torch._register_device_module(BACKEND, _device_module(ext))
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    atexit.register(drain)  # a Python job still queued at exit would touch a dying interpreter
    _ext = ext
    return ext


def _device_module(ext) -> types.ModuleType:
    """``torch.emu``: what torch.get_device_module / torch.accelerator expect of a backend module."""
    import torch

    mod = types.ModuleType("torch.emu")
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod._lazy_init = lambda: None
    mod.device_count = ext.device_count
    mod.current_device = ext.current_device
    mod.set_device = lambda d: ext.set_device(torch.device(d).index if not isinstance(d, int) else d)
    mod.synchronize = lambda device=None: torch.accelerator.synchronize(device)
    mod.current_stream = lambda device=None: torch.accelerator.current_stream(device)
    mod.manual_seed = mod.manual_seed_all = lambda seed: None
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    # what FSDP2 asks of a device module (torch.distributed.fsdp's device handle)
    mod.Stream = lambda device=None, priority=0, **kw: torch.Stream(device=device or BACKEND, priority=priority)
    mod.Event = lambda enable_timing=False, **kw: torch.Event(device=BACKEND, enable_timing=enable_timing)
    mod.stream = lambda s: s if s is not None else contextlib.nullcontext()  # torch.Stream is a context manager
    mod.device = lambda d: contextlib.nullcontext()
    return mod


def ext():
    if _ext is None:
        raise RuntimeError("call tests.emulated_device.load() first")
    return _ext


# ------------------------------------------------------------------ the device's Python API
def sleep(tensor, ms: int) -> None:
    """Occupy the current stream of ``tensor``'s device for ``ms`` milliseconds (returns at once)."""
    import torch

    torch.ops.emudev.sleep(tensor, int(ms))


def enqueue(fn, stream=None) -> None:
    """Run ``fn()`` (a Python callable, no arguments) on ``stream``'s worker, in stream order
    (default: the current stream of the current emu device). Exceptions go to ``take_errors()``."""
    import torch

    if stream is None:
        stream = torch.accelerator.current_stream(torch.device(BACKEND, ext().current_device()))
    ext().enqueue_python(fn, stream.device_index, stream.stream_id)


def cpu_view(tensor):
    """A CPU tensor aliasing an emu tensor's memory (no copy, no synchronization)."""
    return ext().cpu_view(tensor)


def host_wait_counts() -> dict:
    """Host-side waits by kind: stream/event/device synchronize calls (each counts), and op_wait
    (an aten op or copy on the host that had to wait for queued work on the current stream)."""
    return dict(ext().host_waits())


def host_waits() -> int:
    return sum(host_wait_counts().values())


def reset_host_waits() -> None:
    ext().reset_host_waits()


def take_errors() -> list:
    """Exceptions raised by Python jobs on stream workers since the last call (messages)."""
    return list(ext().take_errors())


def set_capturing(flag: bool) -> None:
    """Make every emu stream report ``is_capturing()`` (as during CUDA graph capture)."""
    ext().set_capturing(bool(flag))


@contextlib.contextmanager
def capturing():
    set_capturing(True)
    try:
        yield
    finally:
        set_capturing(False)


def drain() -> None:
    """Wait for every stream's queued work (not counted as a host wait)."""
    if _ext is not None:
        _ext.drain_all()
