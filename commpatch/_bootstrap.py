"""Zero-code activation, imported from ``commpatch.pth`` (or ``commpatch run``'s
sitecustomize) only when ``COMMPATCH`` is set.

It patches through a post-import hook on ``torch.distributed.distributed_c10d``, so the
wrappers are in place before any module does ``from torch.distributed import all_reduce``.
The torchrun launcher process itself (no ``RANK`` in its environment) stays inert.
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
    return os.path.basename(argv0) == "torchrun" or argv0.endswith(launcher_files) \
        or any(a in ("torch.distributed.run", "torch.distributed.launch") for a in orig_argv)


def activate() -> None:
    global _done
    if _done:
        return
    _done = True
    from . import _config

    try:
        if not _config.env_active() or _is_launcher():
            return
        _config.resolve()              # bad settings fail here, before the job starts
    except _config.ConfigError as exc:
        sys.stderr.write(f"commpatch: {exc}\n")
        sys.stderr.flush()
        os._exit(2)

    import wrapt

    def on_c10d(module) -> None:
        from . import _session

        try:
            _session.enable()
        except _config.ConfigError as exc:
            sys.stderr.write(f"commpatch: {exc}\n")
            sys.stderr.flush()
            os._exit(2)

    wrapt.register_post_import_hook(on_c10d, "torch.distributed.distributed_c10d")


activate()
