"""Put on PYTHONPATH by `commpatch run`: activates commpatch, then runs any other sitecustomize."""

import importlib.util
import os
import sys

try:
    import commpatch._bootstrap  # noqa: F401  (activates when COMMPATCH is set)
except Exception as exc:  # noqa: BLE001 - never stop the user's program from starting
    sys.stderr.write(f"commpatch: activation failed: {exc!r}\n")

_here = os.path.dirname(os.path.abspath(__file__))
_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
