"""DDP: one row per gradient bucket per step, the constructor's and the bucket rebuild's
collectives, the unused-parameter bitmap all-reduce, user / builtin hooks, bit-identical
gradients, and the profiler as witness on the same run (counts and bytes per gloo op)."""

import pytest

from tests import integration_workers as w
from tests.multiproc import run_ranks


@pytest.fixture(scope="module")
def default_run():
    return run_ranks(w.ddp_default, 3, timeout=120)  # 3 ranks: 1/3 is inexact, a real check


@pytest.fixture(scope="module")
def hooks_run():
    return run_ranks(w.ddp_hooks, 2, timeout=120)


def test_gradients_bit_identical(default_run):
    for res in default_run:
        assert res["identical"]


def test_profiler_witness_counts_and_bytes_match(default_run):
    """Constructor (parameter check, broadcast), bucket rebuild and buckets: what gloo ran. The
    rebuild's kernels go in only at DDP's forwards up to the rebuild (DDP asks at every forward):
    here the no_sync() micro-batch, the first synchronised step and the next, where it happens;
    not at the two forwards after it (each installation costs ~150 us)."""
    for res in default_run:
        assert w.claimed_counts(res["df"]) == res["witness"]
        assert w.claimed_bytes(res["df"]) == res["witness_bytes"]
        assert res["installs"]["rebuild_buckets"] == 3, res["installs"]


def test_batched_grad_copy_gradients_bit_identical():
    """DDP(batched_grad_copy=True) divides each flat bucket (x / d) where the default copy scales
    (x * (1/d)): with 3 ranks the two differ in the last bit, and commpatch's hook, which replaces
    the reducer's arithmetic, must use the one this reducer would."""
    results = run_ranks(w.ddp_batched_copy, 3, timeout=120)  # 3 ranks: 1/3 is inexact
    if results[0] is None:
        pytest.skip("this torch's DDP has no batched_grad_copy")
    for res in results:
        for view in (False, True):
            assert res[(view, "buckets")] > 0, res
            assert res[(view, "C hook")] and res[(view, "Python hook")], res


def test_lazy_bucket_allocation_gradients_bit_identical():
    """DDP(lazy_bucket_allocation=True, gradient_as_bucket_view=True) divides in place the gradients
    defined when a bucket gets its storage (its first mark in a backward; at the end of a static
    graph's first one) and scales the ones it copies in: at 3 ranks the two differ in the last bit,
    and commpatch's hook must apply the one the reducer would, gradient by gradient."""
    results = run_ranks(w.ddp_lazy_buckets, 3, timeout=180)  # 3 ranks: 1/3 is inexact
    if results[0] is None:
        pytest.skip("this torch's DDP has no lazy_bucket_allocation")
    for res in results:
        for case, (same, buckets) in res.items():
            assert buckets > 0 and same, (case, res)


@pytest.fixture(scope="module")
def unused_run():
    return run_ranks(w.ddp_unused, 2, timeout=120)


def test_find_unused_parameters_bitmap_allreduce_matches_profiler(unused_run):
    """find_unused_parameters=True with an unused branch, constructor + 5 steps: per gloo op the
    counts and bytes equal the profiler's; one bitmap all-reduce per step (an int32 per
    parameter), attributed to DDP's backward; the kernel is gone after each backward."""
    for res in unused_run:
        df = res["df"]
        assert not res["errors"]
        assert w.claimed_counts(df) == res["witness"]
        assert w.claimed_bytes(df) == res["witness_bytes"]
        bitmap = df[df["op"] == "ddp_unused_allreduce"]
        assert len(bitmap) == 5 and (bitmap["bytes"] == 4 * len(res["params"])).all()
        assert (bitmap["step"].diff().dropna() >= 0).all() and (bitmap["dtype"] == "int32").all()
        assert (bitmap["phase"] == "backward").all() and (bitmap["module"] == "DistributedDataParallel").all()
        assert (bitmap["source"] == "ddp").all() and (bitmap["collective"] == "all_reduce").all()
        assert (bitmap["timing"] == "future").all() and (bitmap["duration_us"] > 0).all()
        assert not any(res["kernels_between_steps"])
        # never a rebuild with find_unused_parameters: its kernels are never put in place
        assert "rebuild_buckets" not in res["installs"] and res["installs"]["unused_parameters"] == 5


def test_c_and_python_bucket_hooks_write_the_same_rows():
    """The C comm hook (record/_hot.c: BucketHook) takes the common case when built, and writes
    what the Python hook writes: the same rows field for field (times aside), the same finalize
    timings, the same gradients; commpatch's own error inside it is counted, never raised."""
    for res in run_ranks(w.ddp_c_and_python_paths, 2, timeout=120):
        df = res["df"]
        buckets = df[df["op"] == "ddp_bucket_allreduce"]
        c = buckets[(buckets["seq"] >= res["lo"]) & (buckets["seq"] < res["mid"])].reset_index(drop=True)
        py = buckets[(buckets["seq"] >= res["mid"]) & (buckets["seq"] < res["hi"])].reset_index(drop=True)
        assert len(c) == len(py) > 4
        cols = [
            "collective",
            "api",
            "source",
            "rank",
            "group",
            "group_size",
            "backend",
            "device",
            "dtype",
            "numel",
            "bytes",
            "peer",
            "async_op",
            "timing",
            "status",
            "tag",
            "module",
            "phase",
            "bucket",
            "bucket_params",
        ]
        assert c[cols].astype(str).equals(py[cols].astype(str))
        # steps: the second training's optimizer is not the one whose steps are counted; the first's are
        assert (c["step"].diff().dropna() >= 0).all() and c["step"].nunique() == 4
        assert c["sync_end_us"].notna().tolist() == py["sync_end_us"].notna().tolist()
        assert c["sync_end_us"].notna().sum() == 4  # one finalize per synchronised backward
        assert c["pack_us"].notna().all() and py["pack_us"].notna().all()  # C and Python packing books
        after = buckets[(buckets["seq"] >= res["hi"]) & (buckets["seq"] < res["unpacked"])]
        assert len(after) == len(c) and after["pack_us"].notna().all() and "ddp.packing" not in res["errors"]
        off = buckets[buckets["seq"] >= res["unpacked"]]  # installed with ddp_packing=False
        assert len(off) == len(c) and off["pack_us"].isna().all()
        assert (c["duration_us"] > 0).all() and (c["host_us"] > 0).all()
        assert res["identical"]
        assert res["errors"].get("ddp.hook") == 4  # the injected fault, once per backward
        assert res["calls"].get("python", 0) == len(py)
        if res["c_rows"]:  # the C path took every bucket
            assert res["calls"].get("c", 0) == 0
        else:
            assert res["calls"].get("c", 0) == len(c)


@pytest.mark.parametrize("kind", ["python", "c"])
def test_packing_books(kind):
    """rows.Packing and its C twin: windows from a gradient's accumulation to the end of the
    reducer's hook or to the next launch, noted at that launch with their part alone (no bucket of
    the model in flight); nothing noted for windows a reset dropped, or while not recording."""
    import time

    from commpatch.record import rows
    from commpatch.record.state import State

    if kind == "c" and rows._hot is None:
        pytest.skip("the C extension is not built")
    out = []
    state = State()  # a State of its own (the C twin reads the slots of that class)
    state.recording = True
    pack = rows._hot.Packing(out, state) if kind == "c" else rows.Packing(out, state)
    stop = lambda: setattr(state, "recording", False)  # noqa: E731
    pc = time.perf_counter_ns

    def window(between=None):
        pack.acc(None)
        time.sleep(0.002)
        if between:
            between()
            time.sleep(0.002)
        pack.post((), ())

    window()
    pack.reset()  # a new forward: the no_sync() window is gone
    pack.launch(1, pc())
    assert out == [] and pack.inflight == 1
    pack.done()
    window()
    pack.launch(2, pc())  # nothing in flight: all of it alone
    seq, total, alone = out[-1]
    assert seq == 2 and total >= 2e6 and alone == total
    window()  # bucket 2 in flight throughout
    pack.launch(3, pc())
    assert out[-1][0] == 3 and out[-1][1] >= 2e6 and out[-1][2] == 0
    window(between=lambda: (pack.done(), pack.completed(None)))  # both complete halfway
    pack.launch(4, pc())
    assert pack.inflight == 1 and 2e6 <= out[-1][2] < out[-1][1]
    pack.acc(None)  # the window of the gradient that completes bucket 5
    time.sleep(0.001)
    pack.launch(5, pc())
    pack.post((), ())  # its hook returns after the launch: closed already
    pack.launch(6, pc())
    assert [o[0] for o in out] == [2, 3, 4, 5] and out[-1][1] >= 1e6
    stop()
    window()
    pack.launch(7, pc())
    assert len(out) == 4


def test_one_row_per_bucket_per_step(default_run):
    for res in default_run:
        df = res["df"]
        buckets = df[df["op"] == "ddp_bucket_allreduce"]
        n_buckets = buckets["bucket"].nunique()
        assert n_buckets > 1
        # step 1 uses the constructor's single bucket, steps 2-4 the rebuilt ones; no_sync adds none
        assert len(buckets) == 1 + 3 * n_buckets
        assert buckets["bytes"].sum() == 4 * sum(res["params"])  # every parameter once per step
        assert (buckets["bucket_params"] > 0).all()
        assert (buckets["phase"] == "backward").all()
        assert (buckets["module"] == "DistributedDataParallel").all()
        assert (buckets["timing"] == "future").all() and (buckets["duration_us"] > 0).all()
        # DDP's packing, noted at each bucket's launch (each bucket's gradients are ready after the
        # previous bucket's launch); none on other rows
        assert buckets["pack_us"].notna().all() and (buckets["pack_us"] > 0).all()
        assert (buckets["pack_alone_us"] >= 0).all() and (buckets["pack_alone_us"] <= buckets["pack_us"]).all()
        assert df.loc[df["op"] != "ddp_bucket_allreduce", ["pack_us", "pack_alone_us"]].isna().all().all()
        ctor = df[df["op"] == "ddp_broadcast_coalesced"]
        assert len(ctor) == 1 and ctor.iloc[0]["bytes"] == sum(res["params"])
        assert (
            (df["op"] == "ddp_verify_params_allgather").sum() == (df["op"] == "ddp_verify_params_broadcast").sum() == 1
        )
        assert (df["op"] == "ddp_rebuild_buckets_broadcast").sum() == 2
        assert (df["op"] == "ddp_unused_allreduce").sum() == 0  # find_unused_parameters=False


def test_disable_leaves_a_pass_through_hook(default_run):
    for res in default_run:
        assert res["rows_after_disable"] == 0 and res["finite"]


def test_model_built_before_enable(hooks_run):
    for out in hooks_run:
        df = out["built_before"]
        assert (df["op"] == "ddp_bucket_allreduce").sum() == 2


def test_user_hook_measured_as_what_ran(hooks_run):
    for out in hooks_run:
        df = out["user_fp16"]
        rows = df[df["op"] == "all_reduce"]
        assert len(rows) == 2 and (rows["dtype"] == "float16").all() and (rows["bucket"] == 0).all()
        assert (df["op"] == "ddp_bucket_allreduce").sum() == 0  # no double count


def test_builtin_hook_still_measured(hooks_run):
    for out in hooks_run:
        df = out["builtin_allreduce"]
        rows = df[df["op"] == "all_reduce"]
        assert len(rows) == 2 and (rows["dtype"] == "float32").all() and (rows["bucket"] == 0).all()


def test_no_sync_shows_no_gradient_rows(hooks_run):
    for out in hooks_run:
        df = out["no_sync_only"]
        assert (df["bucket"] >= 0).sum() == 0
        assert set(df["op"].astype(str)) <= {
            "ddp_verify_params_allgather",
            "ddp_verify_params_broadcast",
            "ddp_broadcast_coalesced",
        }
