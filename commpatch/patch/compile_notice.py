"""One warning when a collective goes into a compiled graph whose collectives commpatch cannot see.

Collectives inside compiled graphs run as ``torch.ops._c10d_functional.*`` calls from the
generated code; ``integrations.compiled`` records them at the dispatcher. What still escapes it:
inductor's C++ wrapper (``cpp_wrapper=True``; AOTInductor generates the same code), which calls
the collective's C++ implementation through its C shim without dispatching the op (measured: no
row), and a graph replayed as a CUDA graph (``torch.compile(mode="reduce-overhead")`` or
inductor's ``triton.cudagraphs``, on a machine with CUDA): a replay launches the captured kernels
without dispatching any op. commpatch says so once per process, naming the collective, at the
moment a collective is traced into such a graph:

- ``dist.*`` calls: dynamo rewrites them through ``traceable_collective_remaps``; commpatch's
  remap table (``RemapTable``) notices the lookup of one of its wrappers (a lookup, in real
  Python, made only while dynamo rewrites such a call).
- functional collectives (DTensor, tensor parallel): AOT autograd runs them as real Python on fake
  tensors while ``torch.compiler.is_compiling()`` is true; the functional-collective wrappers call
  ``collective_compiled`` then.
Which case applies is read from inductor's configuration at that moment (the global setting, or
the options of the compile in progress when torch exposes them). A functional
collective that user code calls directly inside a compiled function is traced by dynamo
symbolically (no real Python runs): that case alone is not announced.
"""

from __future__ import annotations

import sys
import warnings

_said = False  # once per process

MESSAGE = (
    "commpatch: torch.compile traced the collective {name!r} into a graph whose collectives commpatch "
    "cannot record: {reason} (said once; see the docs' timing page, 'What is not measured')"
)


def collective_compiled(name: str) -> None:
    """Called (in real Python, during compilation) when a collective goes into a graph."""
    global _said
    if _said:
        return
    reason = unseen()
    if reason is None:
        return
    _said = True
    text = MESSAGE.format(name=name, reason=reason)
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - warnings turned into errors must not break compilation
        try:
            sys.stderr.write(text + "\n")
        except Exception:  # noqa: BLE001
            pass


def unseen() -> str | None:
    """Why the collectives of the graph being compiled will not reach the dispatcher, or None."""
    try:
        from torch._inductor import config

        options = _compile_options()
        if config.cpp_wrapper or options.get("cpp_wrapper"):
            return (
                "inductor's C++ wrapper (cpp_wrapper=True) calls the collectives' C++ implementation without "
                "dispatching the op"
            )
        if _cuda_available() and (config.triton.cudagraphs or options.get("triton.cudagraphs")):
            return (
                "the graph is replayed as a CUDA graph (mode='reduce-overhead' or triton.cudagraphs), which "
                "launches the captured collectives without dispatching any op"
            )
    except Exception:  # noqa: BLE001 - a best-effort reading of torch internals
        return None
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _compile_options() -> dict:
    """The inductor options of the torch.compile call dynamo is tracing for, when reachable."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    backend = tx.output.compiler_fn if tx is not None else None
    for _ in range(8):  # dynamo wraps the backend (debug wrappers, callbacks)
        config = getattr(backend, "config", None)
        if isinstance(config, dict):
            return config
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if backend is None:
            break
    return {}


class RemapTable(dict):
    """``torch.distributed._functional_collectives.traceable_collective_remaps`` while commpatch
    is enabled: the same mapping (with commpatch's wrappers added), which notices when dynamo
    rewrites one of the wrappers into a functional collective."""

    def __init__(self, original: dict, wrappers) -> None:
        super().__init__(original)
        self.original = original
        self.wrappers = wrappers  # name by wrapper, for the notice

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        name = self.wrappers.get(key)
        if name is not None:
            collective_compiled(name)
        return value
