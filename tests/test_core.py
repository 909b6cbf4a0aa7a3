"""Patch management, settings, CSV round trip and failure isolation (one process, fake backend)."""

import sys
import types
import warnings

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commpatch
from commpatch import session as _session
from commpatch.data.ops import TARGET_NAMES
from commpatch.record import state as _runtime

WORLD = 8


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def originals():
    return {name: getattr(c10d, name) for name in TARGET_NAMES if hasattr(c10d, name)}


def test_enable_installs_one_wrapper_in_both_namespaces_and_disable_restores_identity():
    before = originals()
    commpatch.enable(output="none")
    for name, orig in before.items():
        wrapper = getattr(c10d, name)
        assert wrapper is not orig, name
        assert getattr(dist, name) is wrapper, f"{name}: torch.distributed and distributed_c10d differ"
        assert wrapper.__name__ == orig.__name__ and wrapper.__wrapped__ is orig
    commpatch.disable()
    for name, orig in before.items():
        assert getattr(c10d, name) is orig and getattr(dist, name) is orig, name


def test_enable_twice_is_harmless():
    commpatch.enable(output="none")
    first = dist.all_reduce
    commpatch.enable(output="none")
    assert dist.all_reduce is first
    dist.all_reduce(torch.ones(2))
    assert len(commpatch.log()) == 1
    commpatch.disable()
    commpatch.disable()


def test_names_imported_before_enable_are_patched_and_restored():
    user = types.ModuleType("user_train_script")
    user.all_reduce = dist.all_reduce  # from torch.distributed import all_reduce
    user.raw = dist.all_reduce  # kept on purpose under another name
    sys.modules[user.__name__] = user
    try:
        orig = dist.all_reduce
        commpatch.enable(output="none")
        assert user.all_reduce is dist.all_reduce is not orig
        assert user.raw is orig
        user.all_reduce(torch.ones(3))
        assert commpatch.log()["op"].tolist() == ["all_reduce"]
        commpatch.disable()
        assert user.all_reduce is orig
    finally:
        del sys.modules[user.__name__]


def test_collective_utils_binding_is_patched():
    import importlib

    from commpatch.data.ops import COLLECTIVE_UTILS

    for name in COLLECTIVE_UTILS:  # DTensor's: torch.distributed.tensor since 2.5, _tensor before
        try:
            cu = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(cu, "broadcast"):
            break

    orig = cu.broadcast
    commpatch.enable(output="none")
    assert cu.broadcast is dist.broadcast and cu.scatter is dist.scatter
    commpatch.disable()
    assert cu.broadcast is orig


def test_dynamo_remap_follows_the_wrapper():
    """torch.compile keeps rewriting dist.all_reduce into a functional collective."""
    import torch.distributed._functional_collectives as funcol

    torch_table = funcol.traceable_collective_remaps
    orig = dist.all_reduce
    commpatch.enable(output="none")
    remaps = funcol.traceable_collective_remaps
    assert remaps.get(dist.all_reduce) is remaps.get(orig) is torch_table[orig]  # get(): no compile notice
    wrapper = dist.all_reduce
    commpatch.disable()
    assert funcol.traceable_collective_remaps is torch_table
    assert wrapper not in torch_table and orig in torch_table


def test_ops_setting_limits_what_is_wrapped():
    orig_bc = dist.broadcast
    commpatch.enable(output="none", ops="all_reduce,barrier")
    assert dist.broadcast is orig_bc
    dist.all_reduce(torch.ones(1))
    dist.broadcast(torch.ones(1), 0)
    assert commpatch.log()["op"].tolist() == ["all_reduce"]


@pytest.mark.parametrize(
    "env, value, needle",
    [
        ("COMMPATCH_OPS", "all_reduce,allreduce", "allreduce"),
        ("COMMPATCH_TIMING", "gpu", "auto, host"),
        ("COMMPATCH_SUMMARY", "maybe", "1/0"),
        ("COMMPATCH_OUTPUT", "logs/rank{rank}.txt", ".csv or .parquet"),
        ("COMMPATCH_OUTPUT", "logs/rank{node}.csv", "{rank}"),
    ],
)
def test_bad_env_settings_name_the_variable_and_the_allowed_values(monkeypatch, env, value, needle):
    monkeypatch.setenv(env, value)
    with pytest.raises(commpatch.ConfigError) as err:
        commpatch.enable()
    assert env in str(err.value) and needle in str(err.value)
    assert not commpatch.is_enabled()


def test_bad_keyword_settings_are_rejected():
    with pytest.raises(commpatch.ConfigError, match="unknown setting"):
        commpatch.enable(outptu="x.csv")
    with pytest.raises(commpatch.ConfigError, match="ops.*all_reduce"):
        commpatch.enable(ops=["all_reduce", "nope"])


def test_unwritable_output_is_refused_at_enable_when_strict(tmp_path):
    """COMMPATCH_STRICT=1 keeps the refusal (the default warns and runs: tests/test_faults.py)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(commpatch.ConfigError, match="COMMPATCH_OUTPUT|output"):
        commpatch.enable(output=str(blocker / "rank{rank}.csv"), strict=True)
    assert not commpatch.is_enabled()


def _some_calls():
    t = torch.arange(6, dtype=torch.float16)
    dist.all_reduce(t)
    commpatch.step()
    with commpatch.tag("grads"):
        dist.all_gather_into_tensor(torch.zeros(6 * WORLD, dtype=torch.float16), t)
        dist.all_reduce(torch.ones(2, dtype=torch.int64), async_op=True).wait()
    dist.broadcast(t, src=3)
    dist.barrier()


def test_step_and_tag_columns():
    commpatch.enable(output="none")
    _some_calls()
    df = commpatch.log()
    assert df["op"].tolist() == ["all_reduce", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier"]
    assert df["step"].tolist() == [0, 1, 1, 1, 1]
    assert df["tag"].tolist() == ["", "grads", "grads", "", ""]
    assert df["bytes"].tolist() == [12, 12 * WORLD, 16, 12, 0]
    assert df["dtype"].tolist() == ["float16", "float16", "int64", "float16", "none"]
    assert df["peer"].tolist() == [-1, -1, -1, 3, -1]
    assert df["async_op"].tolist() == [False, False, True, False, False]
    assert (df["seq"].diff().dropna() == 1).all()


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_file_round_trip_gives_the_same_dataframe(tmp_path, suffix):
    commpatch.enable(output="none")
    _some_calls()
    df = commpatch.log()
    path = commpatch.export_csv(str(tmp_path / f"rank{{rank}}{suffix}"))
    assert path.endswith(f"rank0{suffix}")
    back = commpatch.read_csv(path)
    pd.testing.assert_frame_equal(back, df)
    assert list(back.dtypes.astype(str)) == [c[1] for c in commpatch.schema()]


def test_round_trip_without_pyarrow(tmp_path, monkeypatch):
    import commpatch.io as cpio

    commpatch.enable(output="none")
    _some_calls()
    df = commpatch.log()
    monkeypatch.setattr(cpio.writer, "_pyarrow", lambda: None)
    path = cpio.write(df, str(tmp_path / "r.csv"))
    pd.testing.assert_frame_equal(cpio.read(path), df)


def test_capture_scopes_recording_and_reset_clears():
    dist.all_reduce(torch.ones(1))  # not enabled: nothing
    with commpatch.capture() as cap:
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(4), 0)
    assert not commpatch.is_enabled()
    dist.all_reduce(torch.ones(1))  # disabled again: nothing
    assert cap.df["op"].tolist() == ["all_reduce", "broadcast"]
    commpatch.enable(output="none")
    dist.all_reduce(torch.ones(1))
    with commpatch.capture() as inner:
        dist.barrier()
    assert commpatch.is_enabled() and inner.df["op"].tolist() == ["barrier"]
    seq_before = commpatch.log()["seq"].max()
    commpatch.reset()
    assert len(commpatch.log()) == 0
    dist.all_reduce(torch.ones(1))
    assert commpatch.log()["seq"].tolist() == [seq_before + 1]


@pytest.mark.faults
def test_internal_failure_never_breaks_the_collective(monkeypatch):
    """A fault inside commpatch: the collective runs and returns; one warning; counted."""
    _runtime.reset_errors()
    commpatch.enable(output="none")

    def broken(group):
        raise KeyError("injected")

    monkeypatch.setattr(_session.default().log, "group_id", broken)
    _session.default().log.group_ids.clear()
    t = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="internal error") as record:
        for _ in range(5):
            assert dist.all_reduce(t) is None
        work = dist.all_reduce(t, async_op=True)
        work.wait()
    assert len([w for w in record if "commpatch" in str(w.message)]) == 1
    assert commpatch.internal_errors()["read"] == 6
    assert len(commpatch.log()) == 0


@pytest.mark.faults
def test_timing_failure_keeps_the_row(monkeypatch):
    _runtime.reset_errors()
    commpatch.enable(output="none")

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(_session.default().timing, "future", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce(torch.ones(3), async_op=True).wait()
    df = commpatch.log()
    assert df["timing"].tolist() == ["none"] and commpatch.internal_errors()["timing"] == 1


def test_compaction_keeps_every_row_and_late_durations():
    """More rows than one compaction chunk, async ones resolved after their chunk was compacted."""
    from commpatch.record.log import CHUNK

    commpatch.enable(output="none")
    t = torch.ones(1)
    n = CHUNK + 100
    for i in range(n):
        dist.all_reduce(t, async_op=bool(i % 2))
    df = commpatch.log()
    assert len(df) == n and df["seq"].is_unique
    # group_seq keeps counting across reset(): consecutive from wherever this group stood
    assert (df["group_seq"].diff().dropna() == 1).all()
    assert df.loc[df["async_op"], "timing"].eq("future").all()
    assert df["duration_us"].notna().all()
    assert _session.default().log.nbytes() / n < 120


def test_torch_compile_runs_unchanged_and_its_collectives_are_seen_at_the_dispatcher():
    """dynamo rewrites dist.all_reduce (our wrapper included) into a functional collective inside
    the graph: the Python wrapper does not run, the dispatcher kernel (integrations.compiled)
    records it, once. fullgraph=True proves the wrapper causes no graph break; the kernels go
    away at disable()."""
    import torch._dynamo

    from tests.integration_workers import python_kernel

    def fn(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    commpatch.enable(output="none")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(4)), fn(torch.ones(4)))
    assert commpatch.log()["op"].tolist() == ["compiled.all_reduce", "all_reduce"]
    assert python_kernel("_c10d_functional::all_reduce")
    commpatch.disable()
    assert not python_kernel("_c10d_functional::all_reduce")
    torch._dynamo.reset()


def test_collective_api_and_source_are_separate_columns():
    """One column each for the collective that ran, the function called and who issued it; the
    summary groups by collective, so one collective's bandwidth is one row whatever API issued it."""
    from commpatch.data.ops import OP_NAMES, describe_op

    kinds = {describe_op(op)[0] for op in OP_NAMES}
    assert kinds == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "all_to_all",
        "gather",
        "scatter",
        "barrier",
        "send",
        "recv",
        "send_recv",
    }
    assert describe_op("ddp_bucket_allreduce") == ("all_reduce", "Reducer.allreduce", "ddp")
    assert describe_op("funcol.all_gather") == ("all_gather", "all_gather", "funcol")
    assert describe_op("coalesced.reduce_scatter_single") == ("reduce_scatter", "reduce_scatter_single", "coalescing")
    commpatch.enable(output="none")
    out = torch.zeros(2 * WORLD)
    dist.all_gather_into_tensor(out, torch.ones(2))
    dist.all_gather(list(out.chunk(WORLD)), torch.ones(2))
    dist.all_reduce(torch.ones(2))
    df = commpatch.log()
    summary = commpatch.summary(df)
    assert df["collective"].astype(str).tolist() == ["all_gather", "all_gather", "all_reduce"]
    assert df["api"].astype(str).tolist() == ["all_gather_into_tensor", "all_gather", "all_reduce"]
    assert set(df["source"].astype(str)) == {"c10d"}
    assert summary.set_index("collective")["count"].to_dict() == {"all_gather": 2, "all_reduce": 1}


def _workload():
    """Every shape of fast-path row: a dtype seen first, a peer, no tensor, a sparse tensor (no
    nbytes), a list op, step / tag changes, a call torch rejects, and one on the slow path."""
    t, i = torch.ones(3), torch.arange(6)
    dist.all_reduce(t)
    dist.all_reduce(i)
    commpatch.step()
    with commpatch.tag("phase b"):
        dist.broadcast(t, src=3)
        dist.barrier()
    dist.all_reduce(torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (5,)))
    dist.all_gather([torch.empty(3) for _ in range(WORLD)], t)
    with pytest.raises(TypeError):
        dist.all_reduce(t, op="not an op")
    dist.all_reduce(t, async_op=True).wait()


def test_c_recorder_writes_the_rows_the_python_path_writes(monkeypatch):
    """The C tail (record/_hot.c) and the pure-Python tail give the same rows, field for field."""
    from commpatch.record import rows

    if not rows.C_ROWS:
        pytest.skip("the C recorder is not built here: only the Python path runs")
    logs = {}
    for c_rows in (True, False):
        monkeypatch.setattr(rows, "C_ROWS", c_rows)
        commpatch.disable()
        commpatch.reset()
        commpatch.enable(output="none")
        wrapper = dist.all_reduce.__code__
        assert ("call" in wrapper.co_names) is c_rows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _workload()
        logs[c_rows] = commpatch.log()
    commpatch.disable()
    keep = ["op", "dtype", "numel", "bytes", "peer", "step", "tag", "status", "timing", "async_op", "group"]
    c, py = (logs[k][keep].reset_index(drop=True) for k in (True, False))
    for df in (c, py):
        df["step"] -= df["step"].min()  # the step counter goes on across reset()
    pd.testing.assert_frame_equal(c, py)
    assert c["status"].tolist().count("error") == 1 and c["numel"].tolist()[:2] == [3, 6]
    assert (logs[True]["host_us"] >= 0).all() and logs[True]["seq"].is_unique


def test_the_recorder_passes_calls_through_when_not_recording_and_hands_back_nested_ones():
    """The C recorder checks STATE itself: not recording, the call runs with no row (and no read
    counted as a failure); while a nesting op runs in another thread (STATE.nesting), the Python
    path takes the call and writes the same row."""
    commpatch.reset()
    commpatch.enable(output="none")
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        _runtime.STATE.recording = False
        dist.all_reduce(t)
        assert dist.all_reduce(t, async_op=True) is not None  # torch's Work, untouched
        _runtime.STATE.recording = True
        _runtime.STATE.nesting += 1  # another thread's object collective: depth 0 here
        try:
            dist.all_reduce(t)
        finally:
            _runtime.STATE.nesting -= 1
        df = commpatch.log()
    finally:
        _runtime.STATE.recording = True
        commpatch.disable()
    assert df["op"].tolist() == ["all_reduce", "all_reduce"] and df["numel"].tolist() == [4, 4]
    assert df["seq"].is_unique and not commpatch.internal_errors()


def test_the_sequence_counter_and_the_recorders_dtype_memory():
    """SEQ (``_hot.Counter`` where built) counts as itertools.count does (next, repr, peek_seq) and
    the C recorder takes its numbers from it: rows of the C path and of the Python path (an object
    collective) interleaved have consecutive seqs. Calls alternating dtypes each get their own dtype
    (the recorder remembers the last dtype's code)."""
    import itertools

    from commpatch.record import rows

    counters = [itertools.count(5)] + ([rows._hot.Counter(5)] if rows._hot is not None else [])
    for c in counters:
        assert [next(c) for _ in range(3)] == [5, 6, 7] and repr(c) == "count(8)" and rows.peek_seq(c) == 8
        assert next(iter(c)) == 8 and rows.peek_seq(c) == 9
    if rows._hot is not None:
        assert isinstance(rows.SEQ, rows._hot.Counter)
        with pytest.raises(TypeError):
            rows._hot.Counter("x")
    commpatch.reset()
    commpatch.enable(output="none")
    try:
        kinds = [torch.float32, torch.float64, torch.int64, torch.float32, torch.bfloat16, torch.float64]
        for dtype in kinds:
            dist.all_reduce(torch.ones(3, dtype=dtype))
        dist.all_gather_object([None] * dist.get_world_size(), {"a": 1})  # the Python path's row between C rows
        dist.all_reduce(torch.ones(2, dtype=torch.int64))
        df = commpatch.log()
    finally:
        commpatch.disable()
    assert df["dtype"].astype(str).tolist()[: len(kinds)] == [str(k).replace("torch.", "") for k in kinds]
    assert df["dtype"].astype(str).tolist()[-1] == "int64" and df["numel"].tolist()[-1] == 2
    seqs = df["seq"].tolist()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    assert not commpatch.internal_errors()


def test_taking_rows_from_the_buffer_keeps_what_follows():
    """The flusher's take, in Python and in C where built: the first n bytes out, the rest kept in
    order, appends after it land behind; under a buffer export (a memoryview) both refuse as
    bytearray does; the C one keeps the storage for the next rows."""
    from commpatch.record import rows

    takes = [rows.take_rows_py] + ([rows._hot.take] if rows.C_ROWS else [])
    for take in takes:
        buf = bytearray(bytes(range(200)) * 10)
        size = sys.getsizeof(buf)
        assert take(buf, 0) == b"" and len(buf) == 2000
        assert take(buf, 150) == bytes(range(150)) and bytes(buf[:50]) == bytes(range(150, 200))
        assert take(buf, 1850) == bytes(range(150, 200)) + bytes(range(200)) * 9 and len(buf) == 0
        if take is not rows.take_rows_py:
            assert sys.getsizeof(buf) >= size  # the storage stays for the next rows
        buf += b"xyz"
        assert bytes(buf) == b"xyz" and take(buf, 3) == b"xyz" and len(buf) == 0
        with pytest.raises(ValueError):
            take(buf, 5)
        buf += b"abcdef"
        view = memoryview(buf)
        with pytest.raises(BufferError):
            take(buf, 2)
        view.release()
        assert take(buf, 2) == b"ab" and bytes(buf) == b"cdef"


@pytest.mark.faults
def test_c_recorder_failure_never_breaks_the_call(monkeypatch):
    """A fault inside the C tail (here: registering a new dtype) keeps the call's result, warns
    once and counts; the next rows are written."""
    _runtime.reset_errors()
    commpatch.enable(output="none")

    class Broken(list):
        def __len__(self):
            raise KeyError("injected")

    monkeypatch.setattr(_session.default().log, "dtype_names", Broken())  # a new dtype cannot register
    t = torch.ones(2, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="internal error"):
        for _ in range(3):
            assert dist.all_reduce(t) is None
    errors = commpatch.internal_errors()  # Python path: "read"; the C recorder: "record"
    assert set(errors) <= {"read", "record"} and sum(errors.values()) == 3
    monkeypatch.undo()
    commpatch.disable()
