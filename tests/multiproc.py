"""Run a function in N real processes joined by a gloo process group, with a timeout.

Workers are module-level functions (spawned processes import them by name). Each returns
a picklable result; an exception in any rank fails the test with that rank's traceback,
and a hang fails it after ``timeout`` seconds instead of stalling the suite.

Ranks are forked from a server process that has imported torch once (multiprocessing's
"forkserver", torch preloaded): each rank still starts from a state no test has touched, without
paying torch's import (about 2 s of CPU a process on this machine) for every rank of every job.
The environment and working directory are the caller's at the time of the call, as with "spawn";
COMMPATCH_TEST_SPAWN=1 starts new interpreters instead ("spawn"), to rule the server out.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import tempfile
import traceback

PRELOAD = ["torch", "torch.distributed"]


def default_signals() -> None:
    """A child's signals as a terminal's job has them (a ``preexec_fn``): a test run under ``nohup``
    or as a background job of a shell inherits SIGHUP / SIGINT / SIGQUIT ignored, which Python keeps,
    so a job sent one would not end of it, with or without commpatch."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _context(method=None):
    if method is not None:
        return mp.get_context(method)
    if os.environ.get("COMMPATCH_TEST_SPAWN", "") not in ("", "0"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _as_the_caller(env, cwd) -> None:
    """In a forked rank: the caller's environment and directory (the server's are those of its own
    start), and random state of its own, as a new interpreter would have."""
    if env is None:
        return
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import sys

    if "numpy" in sys.modules:  # seeded once in the server: every rank would draw the same numbers
        sys.modules["numpy"].random.seed()


def _entry(fn, rank, world_size, store_path, q, kwargs, pg_timeout=None, env=None, cwd=None):
    try:
        _as_the_caller(env, cwd)
        import datetime

        import torch.distributed as dist

        extra = {"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout else {}
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, **extra)
        try:
            result = fn(rank, world_size, **kwargs)
        finally:
            if dist.is_initialized():
                from tests.torch_compat import destroy_process_group

                destroy_process_group()
        q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn, world_size: int = 2, timeout: float = 90, pg_timeout: float | None = None, start_method=None, **kwargs
) -> list:
    """``fn(rank, world_size, **kwargs)`` in each rank; ``pg_timeout``: the process group's own
    timeout in seconds (torch's default, 30 min, when None); ``start_method``: multiprocessing's
    (forkserver, or spawn under COMMPATCH_TEST_SPAWN=1, when None)."""
    ctx = _context(start_method)
    forked = ctx.get_start_method() == "forkserver"
    env, cwd = (dict(os.environ), os.getcwd()) if forked else (None, None)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store, q, kwargs, pg_timeout, env, cwd), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors = []
        try:
            for _ in range(world_size):
                rank, ok, value = q.get(timeout=timeout)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        except queue_mod.Empty:
            errors.append(
                f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}"
            )
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def free_port(lo: int = 32000, hi: int = 33000) -> int:
    """A TCP port of [lo, hi) free on 127.0.0.1 now (tried in random order); the test is skipped
    when there is none."""
    import random
    import socket

    import pytest

    for port in random.sample(range(lo, hi), hi - lo):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free TCP port in {lo}-{hi - 1}")
