"""``python -m commpatch.integrations``: each integration's status on the installed torch (active,
partial, unavailable, and why), one line each; run by ``commpatch env`` in a child process, so
that importing torch's internals never weighs on (or breaks) the command itself."""

from __future__ import annotations

import warnings

from ..record.clocksync import unmeasured_stores
from . import ALL, base


def main() -> int:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torch._dynamo  # noqa: F401 - some internals import only after it (functorch's)
        except Exception:  # noqa: BLE001 - then the names that need it are reported missing
            pass
        rows = [(integration, *base.status(integration)) for integration in ALL]
    print(f"integrations on torch {torch.__version__}:")
    width = max(len(integration.name) for integration, _, _ in rows)
    for integration, state, why in rows:
        line = f"  {integration.name.ljust(width)}  {state}"
        if why:
            line += f": {why}"
        print(line)
    gap = unmeasured_stores()
    print(f"clock exchange across hosts: {'partial: ' + gap if gap else 'active'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
