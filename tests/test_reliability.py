"""Faults inside commpatch never reach the user; threads lose nothing; compiled and captured code.

Fault matrix: each fault is injected into commpatch (not into torch), then the same collectives
run. Every collective must still return the right result (checked with real peers on gloo),
exactly one warning is printed per fault kind, and ``internal_errors()`` counts the affected rows.
"""

import contextlib
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

import commpatch
from commpatch import session as _session
from commpatch.record import state as _runtime
from tests.fakepg import fake_world
from tests.multiproc import run_ranks

WORLD = 8


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    with fake_world(WORLD):
        yield


_COMMPATCH_CODE = (os.path.dirname(commpatch.__file__), "<commpatch")


def _commpatch_asks() -> bool:
    return sys._getframe(2).f_code.co_filename.startswith(_COMMPATCH_CODE)


class FakeDevice(torch.Tensor):
    """A CPU tensor that tells commpatch, and only commpatch, that it is on a CUDA device: it
    drives the device path where torch has no accelerator (the device API then raises, as a
    backend without events does), while torch runs the collective as on CPU. The real device
    path is proved on the emulated accelerator (tests/test_emulated_device.py)."""

    @property
    def is_cpu(self):
        return not _commpatch_asks() and torch.Tensor.is_cpu.__get__(self)

    @property
    def device(self):
        return torch.device("cuda", 0) if _commpatch_asks() else torch.Tensor.device.__get__(self)


@contextlib.contextmanager
def devices_on():
    """As in a process with an accelerator: the wrappers test each tensor's device."""
    with mock.patch.object(_runtime.STATE, "devices", True):
        yield


class _Stream:
    def is_capturing(self):
        return False


def injected(*_args, **_kwargs):
    raise RuntimeError("injected fault")


@dataclass(frozen=True)
class Fault:
    name: str
    inject: object  # () -> context manager, entered before enable()
    tensor: type  # torch.Tensor or FakeDevice
    kind: str  # internal_errors() key expected
    affects: tuple  # the kinds of CALLS it hits
    keeps_rows: bool


def _stack(*managers):
    stack = contextlib.ExitStack()
    for m in managers:
        stack.enter_context(m)
    return stack


def _event_raises():
    """The event constructor commpatch uses raises: torch's device-generic one (torch >= 2.6),
    CUDA's own on an older torch."""
    if hasattr(torch, "accelerator") and hasattr(torch, "Event"):
        stream_owner, event_owner, event = torch.accelerator, torch, "Event"
    else:
        stream_owner, event_owner, event = torch.cuda, torch.cuda, "Event"
    return _stack(
        devices_on(),
        mock.patch.object(stream_owner, "current_stream", return_value=_Stream()),
        mock.patch.object(event_owner, event, side_effect=injected),
    )


def _device_start_raises():
    return _stack(devices_on(), mock.patch.object(_session.default().timing, "device_start", side_effect=injected))


CALLS = (
    ("all_reduce", "sync"),
    ("all_reduce", "async"),
    ("broadcast", "sync"),
    ("all_gather", "sync"),
    ("all_gather_object", "object"),
)  # what run_collectives() issues
TENSOR_CALLS = ("sync", "async")
EVERY_CALL = ("sync", "async", "object")
FAULTS = [
    Fault(
        "timing source raises",
        lambda: mock.patch.object(_session.default().timing, "future", side_effect=injected),
        torch.Tensor,
        "timing",
        ("async",),
        True,
    ),
    Fault("device start raises", _device_start_raises, FakeDevice, "timing", TENSOR_CALLS, True),
    Fault("torch.Event raises", _event_raises, FakeDevice, "timing", TENSOR_CALLS, True),
    # this machine has no CUDA: torch.accelerator.current_stream(cuda) itself raises
    Fault("device API unavailable", devices_on, FakeDevice, "timing", TENSOR_CALLS, True),
    # a step beyond int64: struct.pack of the row fails
    Fault(
        "log append raises",
        lambda: mock.patch.object(_runtime.STATE, "step", 2**63),
        torch.Tensor,
        "record",
        EVERY_CALL,
        False,
    ),
]


def expected_count(fault: Fault) -> int:
    return sum(kind in fault.affects for _, kind in CALLS)


def run_collectives(rank: int, world: int, tensor_cls) -> list[str]:
    """The calls of CALLS, in order; returns what came back wrong (gloo: real results)."""
    wrong = []

    def t(*values):
        return torch.tensor(values, dtype=torch.float32).as_subclass(tensor_cls)

    def expect(label, got, want):
        if got != want:
            wrong.append(f"{label}: {got} != {want}")

    total = float(sum(range(1, world + 1)))
    x = t(rank + 1, rank + 1)
    expect("all_reduce returns", dist.all_reduce(x), None)
    expect("all_reduce", x.tolist(), [total] * 2)
    x = t(rank + 1)
    work = dist.all_reduce(x, async_op=True)
    expect("async all_reduce returns a Work", work is not None and work.wait(), True)
    expect("async all_reduce", x.tolist(), [total])
    x = t(rank, rank)
    dist.broadcast(x, src=1)
    expect("broadcast", x.tolist(), [1.0, 1.0])
    out = [t(-1) for _ in range(world)]
    dist.all_gather(out, t(rank))
    expect("all_gather", [o.item() for o in out], [float(r) for r in range(world)])
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    expect("all_gather_object", objs, [{"rank": r} for r in range(world)])
    return wrong


def _warnings_of_commpatch(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("commpatch")]


def _faults_worker(rank, world_size):
    """Every fault in turn, on real peers: results, internal errors, commpatch warnings, rows."""
    out = {}
    for fault in [None] + FAULTS:
        with contextlib.ExitStack() as stack:
            if fault is not None:
                stack.enter_context(fault.inject())
            commpatch.enable(output="none")
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                wrong = run_collectives(rank, world_size, fault.tensor if fault else torch.Tensor)
            commpatch.disable()
        df = commpatch.log()
        out[fault.name if fault else "none"] = (
            wrong,
            commpatch.internal_errors(),
            _warnings_of_commpatch(record),
            len(df),
            int(df["timing"].eq("none").sum()),
        )
        commpatch.reset()
        _runtime.reset_errors()
    return out


@pytest.mark.faults
@pytest.mark.slow
def test_every_fault_leaves_the_results_right_on_real_peers():
    for rank, results in enumerate(run_ranks(_faults_worker, 2, timeout=120)):
        assert results.pop("none") == ([], {}, [], len(CALLS), 0), f"rank {rank}: the run without faults"
        for fault in FAULTS:
            wrong, errors, warned, rows, untimed = results[fault.name]
            assert not wrong, f"rank {rank}, {fault.name}: {wrong}"
            assert errors == {fault.kind: expected_count(fault)}, (rank, fault.name)
            assert len(warned) == 1, (rank, fault.name, warned)
            assert rows == (len(CALLS) if fault.keeps_rows else 0), (rank, fault.name)
            if fault.keeps_rows:  # the rows stay, without a duration where the timing failed
                assert untimed == expected_count(fault), (rank, fault.name)


@pytest.mark.faults
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_matrix_in_process(fault):
    """The same faults on the fake backend, with the watchdog's bookkeeping on: one warning per
    kind, the affected rows counted, nothing left in flight."""
    with fault.inject():
        commpatch.enable(output="none", watchdog=600)
        with pytest.warns(RuntimeWarning) as record:
            for _ in range(3):
                run_collectives(0, WORLD, fault.tensor)
    assert len(_warnings_of_commpatch(record)) == 1
    assert commpatch.internal_errors() == {fault.kind: 3 * expected_count(fault)}
    df = commpatch.log()
    assert len(df) == (3 * len(CALLS) if fault.keeps_rows else 0)
    if fault.tensor is FakeDevice:
        assert (df["device"] == "cuda").sum() == 3 * expected_count(fault)
    assert _session.default().log.pending == {}


@pytest.mark.faults
def test_warnings_turned_into_errors_do_not_turn_faults_into_exceptions(capfd):
    """With ``-W error`` the one warning would raise: it goes to stderr instead."""
    with mock.patch.object(_runtime.STATE, "step", 2**63):
        commpatch.enable(output="none")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run_collectives(0, WORLD, torch.Tensor)
    assert commpatch.internal_errors() == {"record": len(CALLS)}
    assert capfd.readouterr().err.count("commpatch: internal error (record)") == 1


class Subclass(torch.Tensor):
    """A tensor subclass with torch's default __torch_function__ (nn.Parameter disables it)."""


def test_a_tensor_subclass_is_one_row_per_call():
    """c10d hands subclasses to __torch_function__, which calls the (patched) function again:
    found by the fault matrix (a device-faking subclass gave two rows per call)."""
    commpatch.enable(output="none")
    x = torch.ones(2).as_subclass(Subclass)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    dist.all_reduce(x, async_op=True).wait()
    dist.broadcast(torch.nn.Parameter(torch.ones(2)), src=0)
    df = commpatch.log()
    assert df["op"].tolist() == ["all_reduce", "broadcast", "all_reduce", "broadcast"]
    assert df["bytes"].tolist() == [8] * 4 and df["timing"].tolist() == ["host", "host", "future", "host"]


# ---- faults at exit: a fresh interpreter each ---------------------------------------------

EXIT_SCRIPT = """
import atexit, os, shutil, sys, time
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import commpatch

out = sys.argv[1]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
for _ in range(5):
    dist.all_reduce(torch.ones(2))


def fault():  # at exit, right before commpatch's own exit handler (atexit runs the last registered first)
    FAULT
    time.sleep(0.5)  # the flusher (every 0.2 s) passes meanwhile: the exit's one warning must still be the only one


atexit.register(fault)
print("job done")
"""
EXIT_FAULTS = {
    "output directory removed": "shutil.rmtree(out)",
    "output directory replaced by a file": "shutil.rmtree(out); open(out, 'w').write('not a directory')",
    "pandas missing at export": "sys.modules['pandas'] = None",
    "the CSV writer raises": "import commpatch.io.writer as e; e.write_small_csv = lambda *a, **k: 1 / 0",
}


@pytest.mark.faults
@pytest.mark.parametrize("fault", EXIT_FAULTS)
def test_exit_faults_keep_exit_status_0_with_one_warning_counting_the_rows(tmp_path, fault):
    out = tmp_path / "logs"
    script = EXIT_SCRIPT.replace("FAULT", EXIT_FAULTS[fault])
    env = dict(os.environ, COMMPATCH="0", PYTHONWARNINGS="default")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "job done\n"
    warned = [ln for ln in proc.stderr.splitlines() if "commpatch:" in ln]
    if fault == "pandas missing at export":  # a small log's CSV needs neither pandas nor pyarrow
        assert not warned, proc.stderr
        assert len(commpatch.read_csv(str(out / "rank0.csv"))) == 5
        return
    assert len(warned) == 1, proc.stderr
    if fault == "the CSV writer raises":  # the rows are safe in the binary log
        assert "ZeroDivisionError" in warned[0] and "binary log (.cplog)" in warned[0]
        assert len(commpatch.read_csv(str(out))) == 5
        return
    assert "5 row(s) of this rank's log were NOT written" in warned[0]  # the binary log was deleted


# ---- threads --------------------------------------------------------------------------------


def test_eight_threads_on_eight_groups_lose_and_duplicate_nothing():
    """10k calls per thread, each thread on its own group (fake backend), async calls mixed in
    and the watchdog's bookkeeping on: every row once, group_seq 0..n-1 per group."""
    threads_n, calls = 8, 10_000
    groups = [dist.new_group(list(range(WORLD))) for _ in range(threads_n)]
    commpatch.enable(output="none", watchdog=600)
    barrier = threading.Barrier(threads_n)
    failures = []

    def issue(group):
        try:
            t = torch.ones(2)
            barrier.wait()
            for i in range(calls):
                if i % 5 == 0:
                    dist.all_reduce(t, group=group, async_op=True).wait()
                else:
                    dist.all_reduce(t, group=group)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    workers = [threading.Thread(target=issue, args=(g,)) for g in groups]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not failures
    df = commpatch.log()
    assert len(df) == threads_n * calls and df["seq"].is_unique
    assert sorted(df["group"].unique()) == sorted(g.group_name for g in groups)
    for _, rows in df.groupby("group", observed=True):
        assert len(rows) == calls
        assert np.array_equal(np.sort(rows["group_seq"].to_numpy()), np.arange(calls))
        assert rows["seq"].is_monotonic_increasing and rows["group_seq"].is_monotonic_increasing
    assert df.loc[df["async_op"], "duration_us"].notna().all()
    assert _session.default().log.pending == {}
    for g in groups:
        dist.destroy_process_group(g)


# ---- compiled code ----------------------------------------------------------------------------


def _compiled_step(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def _compile_warnings(record) -> list[str]:
    return [m for m in _warnings_of_commpatch(record) if "torch.compile" in m]


@pytest.fixture
def cuda_graphs_on(monkeypatch):
    """What commpatch reads to know a compiled graph will be a CUDA graph (none on this machine).
    The inductor option is set with torch's own ``config.patch``: monkeypatch's undo of an
    attribute of a config proxy deletes it (``SubConfigProxy ... has no attribute 'cudagraphs'``
    in a later test), torch's restores the value."""
    import torch._inductor.config

    from commpatch.patch import compile_notice as _compile_notice

    monkeypatch.setattr(_compile_notice, "_cuda_available", lambda: True)
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        yield


def test_torch_compile_is_announced_once_and_the_hook_goes_away_on_disable(monkeypatch, cuda_graphs_on):
    """Collectives compiled into a graph replayed as a CUDA graph are the ones commpatch cannot
    see: said once, naming the collective; nothing once disabled."""
    import torch._dynamo
    import torch.distributed._functional_collectives as funcol

    from commpatch.patch import compile_notice as _compile_notice

    monkeypatch.setattr(_compile_notice, "_said", False)
    before = funcol.traceable_collective_remaps
    torch._dynamo.reset()
    commpatch.enable(output="none")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = torch.compile(_compiled_step, backend="eager")
        second = torch.compile(lambda x: _compiled_step(x) * 3, backend="eager")
        assert torch.equal(first(torch.ones(4)), _compiled_step(torch.ones(4)))
        assert torch.equal(second(torch.ones(4)), _compiled_step(torch.ones(4)) * 3)
    said = _compile_warnings(record)
    assert len(said) == 1 and "cannot record" in said[0] and "'all_reduce'" in said[0] and "CUDA graph" in said[0]
    commpatch.disable()
    assert funcol.traceable_collective_remaps is before and not any(
        hasattr(k, "__commpatch_original__") for k in before
    )
    monkeypatch.setattr(_compile_notice, "_said", False)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(_compiled_step, backend="eager")(torch.ones(4))
    assert not _compile_warnings(record), "disabled: nothing to say"
    torch._dynamo.reset()


def test_torch_compile_without_cuda_graphs_or_collectives_says_nothing(monkeypatch):
    """The notice is for collectives really missed: compiling a model without one is silent, as is
    a compiled function whose collective runs eagerly (a ``torch._dynamo.disable``d call: recorded),
    and a compiled collective outside CUDA graphs (recorded at the dispatcher)."""
    import torch._dynamo

    from commpatch.patch import compile_notice as _compile_notice

    monkeypatch.setattr(_compile_notice, "_said", False)
    torch._dynamo.reset()
    commpatch.enable(output="none")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))

    eager_all_reduce = torch._dynamo.disable(dist.all_reduce)

    def broken(x):
        y = model(x)
        eager_all_reduce(y)
        return y

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend="eager", fullgraph=True)(torch.ones(2, 4)).sum().backward()
        torch.compile(broken, backend="eager")(torch.ones(2, 4))
        torch.compile(_compiled_step, backend="eager", fullgraph=True)(torch.ones(4))
    assert not _compile_warnings(record)
    assert commpatch.log()["op"].tolist() == ["all_reduce", "compiled.all_reduce"]
    torch._dynamo.reset()


def test_torch_compile_with_warnings_as_errors_still_compiles(monkeypatch, capfd, cuda_graphs_on):
    import torch._dynamo

    from commpatch.patch import compile_notice as _compile_notice

    monkeypatch.setattr(_compile_notice, "_said", False)
    torch._dynamo.reset()
    commpatch.enable(output="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # torch's own, on Python 3.13.0 (torch 2.15): not commpatch's, and raised without it too
        warnings.filterwarnings("ignore", message="Guards may run slower", category=RuntimeWarning)
        compiled = torch.compile(_compiled_step, backend="eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(4)), _compiled_step(torch.ones(4)))
    assert "torch.compile" in capfd.readouterr().err
    torch._dynamo.reset()


# ---- the user's own mistakes are torch's errors, unchanged ----------------------------------------
BEFORE_INIT = """
import warnings
import torch
import torch.distributed as dist
import commpatch

warnings.simplefilter("error")  # a commpatch warning would be raised here
commpatch.enable(output="none")
try:
    dist.all_reduce(torch.ones(2))
except Exception as exc:
    print(type(exc).__name__, exc.__context__ is None, exc.__cause__ is None)
    print(exc)
print("internal", commpatch.internal_errors())
"""


def test_a_collective_before_init_process_group_raises_torchs_error_once_and_no_internal_error():
    """Issue 32: ``all_reduce`` before ``init_process_group`` was printed as ``commpatch: internal
    error (read)``, then torch's error raised a second time, chained to the first."""
    proc = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ValueError True True", proc.stdout  # raised once: nothing chained to it
    assert "init_process_group" in lines[1]
    assert lines[2] == "internal {}", proc.stdout
    assert "commpatch" not in proc.stderr, proc.stderr
