"""Zero-code activation, imported from ``commpatch.pth`` (or ``commpatch run``'s
sitecustomize) only when ``COMMPATCH`` is set.

It patches through a post-import hook on ``torch.distributed.distributed_c10d``, so the
wrappers are in place before any module does ``from torch.distributed import all_reduce``.
The torchrun launcher process itself (no ``RANK`` in its environment) stays inert. Settings are
checked in that hook too: a process that never imports torch.distributed (pip, a data script,
``commpatch env``) runs as without commpatch, whatever the ``COMMPATCH_*`` values; one that does
stops at once with exit status 2 and a one-line message on a bad value.
"""

from __future__ import annotations

import os
import sys

_done = False


def _is_launcher() -> bool:
    if "RANK" in os.environ:
        return False
    argv0 = sys.argv[0] if getattr(sys, "argv", None) else ""
    orig_argv = getattr(sys, "orig_argv", [])
    launcher_files = (os.path.join("torch", "distributed", "run.py"), os.path.join("torch", "distributed", "launch.py"))
    return (
        os.path.basename(argv0) == "torchrun"
        or argv0.endswith(launcher_files)
        or any(a in ("torch.distributed.run", "torch.distributed.launch") for a in orig_argv)
    )


def activate() -> None:
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("COMMPATCH", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    module = sys.modules.get(C10D)
    if module is not None:
        _on_c10d(module)
    else:
        sys.meta_path.insert(0, _C10DFinder())


C10D = "torch.distributed.distributed_c10d"


class _C10DFinder:
    """Calls ``_on_c10d`` right after ``torch.distributed.distributed_c10d`` is executed: a
    post-import hook for one module, without importing wrapt (~20 ms) into every process."""

    def find_spec(self, name, path, target=None):
        if name != C10D:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once; and the real finders answer below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_activate(module):
            exec_module(module)
            _on_c10d(module)

        spec.loader.exec_module = exec_then_activate
        return spec


def _on_c10d(module) -> None:
    from . import config, session  # lazy: this module is imported in every process with COMMPATCH set

    try:
        if not config.env_active() or _is_launcher():
            return
        session.enable()
    except config.ConfigError as exc:
        sys.stderr.write(f"commpatch: {exc}\n")
        sys.stderr.flush()
        os._exit(2)


activate()
