"""Analysis functions on hand-built frames: bandwidth formulas (nccl-tests), the summary, the
per-step view and the scaling view, checked against values computed by hand."""

import math

import numpy as np
import pandas as pd
import pytest

from commpatch import analysis
from commpatch.data.schema import COLUMNS, SCHEMA
from commpatch.testing import make_log


def frame(rows):
    """A log frame with the SCHEMA's columns; ``rows`` give the interesting values."""
    defaults = {"category": "", "int64": 0, "float64": np.nan, "bool": False}
    base = {c.name: defaults[c.dtype] for c in SCHEMA}
    base.update(group="0", timing="host", status="ok", dtype="float32", peer=-1, bucket=-1, tensors=1)
    df = pd.DataFrame([{**base, **r} for r in rows])
    for c in SCHEMA:
        if c.dtype == "category":
            df[c.name] = df[c.name].astype(str).astype("category")
        else:
            df[c.name] = df[c.name].astype(c.dtype)
    df["host_us"] = df["duration_us"]
    return analysis.add_bandwidth(df)[list(COLUMNS)]


# (op, group size, expected bus factor) as nccl-tests defines it (doc/PERFORMANCE.md)
FACTORS = [
    ("all_reduce", 4, 2 * 3 / 4),
    ("all_reduce", 2, 1.0),
    ("all_reduce", 8, 2 * 7 / 8),
    ("all_reduce", 1, 0.0),
    ("all_gather", 8, 7 / 8),
    ("all_gather_into_tensor", 4, 3 / 4),
    ("reduce_scatter_tensor", 2, 1 / 2),
    ("reduce_scatter", 4, 3 / 4),
    ("all_to_all_single", 4, 3 / 4),
    ("all_to_all", 8, 7 / 8),
    ("broadcast", 4, 1.0),
    ("reduce", 8, 1.0),
    ("send", 2, 1.0),
    ("recv", 2, 1.0),
    ("isend", 4, 1.0),
    ("gather", 4, 3 / 4),
    ("scatter", 8, 7 / 8),
]


@pytest.mark.parametrize("op,n,factor", FACTORS, ids=[f"{o}-n{n}" for o, n, _ in FACTORS])
def test_bus_bandwidth_by_hand(op, n, factor):
    # 3 GB in 1.5 s: algbw 2 GB/s whatever the op; busbw = 2 x factor(n)
    df = frame([dict(op=op, group_size=n, world_size=16, bytes=3_000_000_000, duration_us=1.5e6)])
    assert df["algbw_gbps"].iloc[0] == pytest.approx(2.0)
    assert df["busbw_gbps"].iloc[0] == pytest.approx(2.0 * factor)
    s = analysis.summary(df)
    assert s["busbw_gbps"].iloc[0] == pytest.approx(2.0 * factor) if factor else math.isnan(s["busbw_gbps"].iloc[0])


def test_own_time_leaves_out_the_wait_behind_earlier_calls_of_the_group():
    from commpatch.data.frame import own_times
    from commpatch.data.schema import T_DEVICE, T_FUTURE, T_HOST, T_NCCL, T_NONE

    t0 = 1_700_000_000_000_000_000  # Unix ns: differences must stay exact
    # group 0: a 50 us call, one issued at 10 us that completed at 15 us (overtook it: not queued),
    # one issued at 12 us completing at 53 us (queued behind the first: its own 3 us);
    # group 1 is independent; nccl is kernel time already; device rows come from the device
    keys = np.array([0, 0, 1, 0, 0, 0, 0])
    start = t0 + np.array([0, 10, 11, 12, 100, 200, 300]) * 1000
    dur = np.array([50, 5, 3, 41, 2, 7, np.nan]) * 1000.0
    timing = np.array([T_FUTURE, T_FUTURE, T_HOST, T_FUTURE, T_HOST, T_NCCL, T_NONE])
    own = own_times(np, keys, start, dur, timing) / 1000
    assert own[:6].tolist() == [50, 5, 3, 3, 2, 7] and math.isnan(own[6])
    device = own_times(np, keys[:1], start[:1], dur[:1], np.array([T_DEVICE]), np.array([4000.0]))
    assert device.tolist() == [4000.0]
    df = frame([dict(op="all_reduce", group_size=2, bytes=10**6, duration_us=1000.0, own_us=10.0)])
    assert df["algbw_gbps"].iloc[0] == pytest.approx(100.0)  # from the own time, not the duration
    s = analysis.summary(df)
    assert s[["total_us", "own_us"]].iloc[0].tolist() == [1000.0, 10.0] and s["algbw_gbps"].iloc[0] == pytest.approx(
        100.0
    )


def test_subgroup_uses_its_own_size_not_the_world():
    df = frame([dict(op="all_reduce", group="sub", group_size=2, world_size=8, bytes=10**9, duration_us=1e6)])
    assert df["busbw_gbps"].iloc[0] == pytest.approx(1.0)  # 2(n-1)/n with n=2, not n=8


def test_no_bandwidth_for_barriers_and_unmeasured_calls():
    df = frame(
        [
            dict(op="barrier", group_size=4, bytes=0, duration_us=10.0),
            dict(op="all_reduce", group_size=4, bytes=1000, duration_us=np.nan, timing="none"),
        ]
    )
    assert df["busbw_gbps"].isna().all() and df["algbw_gbps"].isna().all()


def test_summary_by_op_and_size_bucket():
    rows = [dict(op="all_reduce", group_size=2, bytes=1000, duration_us=d) for d in (1.0, 2.0, 3.0, 4.0)]
    rows += [
        dict(op="all_reduce", group_size=2, bytes=5000, duration_us=10.0),
        dict(op="all_reduce", group_size=2, bytes=5000, duration_us=np.nan, timing="none"),
        dict(op="broadcast", group_size=2, bytes=64, duration_us=30.0),
    ]
    s = analysis.summary(frame(rows), by=["op", "size_bucket"])
    assert list(s.columns) == [
        "op",
        "size_bucket",
        "count",
        "total_us",
        "mean_us",
        "p50_us",
        "p95_us",
        "max_us",
        "own_us",
        "transfer_us",
        "bytes",
        "unmeasured",
        "algbw_gbps",
        "busbw_gbps",
        "busbw_with_wait_gbps",
        "time_share",
    ]
    assert s["op"].astype(str).tolist() == ["broadcast", "all_reduce", "all_reduce"]  # by total time
    small = s[(s["op"] == "all_reduce") & (s["size_bucket"] == 1024)].iloc[0]
    assert small["count"] == 4 and small["total_us"] == 10.0 and small["p50_us"] == 2.5
    assert small["p95_us"] == pytest.approx(np.quantile([1, 2, 3, 4], 0.95))
    assert small["algbw_gbps"] == pytest.approx(4000 / 10e-6 / 1e9)
    assert small["busbw_gbps"] == pytest.approx(small["algbw_gbps"])  # 2(n-1)/n = 1 at n=2
    big = s[s["size_bucket"] == 8192].iloc[0]
    assert big["count"] == 2 and big["unmeasured"] == 1 and big["bytes"] == 10000
    assert big["algbw_gbps"] == pytest.approx(5000 / 10e-6 / 1e9)  # measured bytes only
    assert s["time_share"].sum() == pytest.approx(1.0)
    assert s.loc[s["op"] == "broadcast", "time_share"].iloc[0] == pytest.approx(30 / 50)


def test_size_buckets_are_powers_of_two():
    assert analysis.size_bucket([0, 1, 2, 3, 1024, 1025]).tolist() == [0, 1, 2, 4, 1024, 2048]


def test_per_step_busy_exposed_and_share():
    t0 = 1_700_000_000_000_000_000
    us = 1000
    rows = [  # rank 0, step 0: a blocking call [0, 10] and an async one [5, 20] us; step 1 starts at 100
        dict(rank=0, step=0, op="all_reduce", start_ns=t0, duration_us=10.0, group_size=2, bytes=8),
        dict(
            rank=0,
            step=0,
            op="all_reduce",
            start_ns=t0 + 5 * us,
            duration_us=15.0,
            async_op=True,
            timing="future",
            group_size=2,
            bytes=8,
        ),
        dict(rank=0, step=1, op="all_reduce", start_ns=t0 + 100 * us, duration_us=4.0, group_size=2, bytes=8),
        dict(rank=1, step=0, op="all_reduce", start_ns=t0, duration_us=30.0, group_size=2, bytes=8),
        dict(rank=1, step=1, op="all_reduce", start_ns=t0 + 80 * us, duration_us=2.0, group_size=2, bytes=8),
    ]
    ps = analysis.per_step(frame(rows))
    r0 = ps[(ps["rank"] == 0) & (ps["step"] == 0)].iloc[0]
    assert r0["calls"] == 2 and r0["comm_us"] == 25.0 and r0["busy_us"] == pytest.approx(20.0)
    assert r0["exposed_us"] == 10.0 and r0["overlap_unknown_us"] == 15.0
    assert r0["step_us"] == pytest.approx(100.0) and r0["step_time_from"] == "log"
    assert r0["comm_share"] == pytest.approx(0.2) and r0["exposed_share"] == pytest.approx(0.1)
    last = ps[(ps["rank"] == 0) & (ps["step"] == 1)].iloc[0]
    assert math.isnan(last["step_us"]) and last["step_time_from"] == "none"
    mean = analysis.per_step(frame(rows), by_rank=False)
    s0 = mean[mean["step"] == 0].iloc[0]
    assert s0["ranks"] == 2 and s0["comm_us"] == pytest.approx((25 + 30) / 2)
    assert s0["max_comm_us"] == 30.0 and s0["max_rank"] == 1 and s0["step_us"] == pytest.approx(90.0)
    user = analysis.per_step(frame(rows), steps=pd.DataFrame({"step": [0, 1], "duration_us": [200.0, 50.0]}))
    assert set(user["step_time_from"]) == {"user"}
    assert user.loc[(user["rank"] == 0) & (user["step"] == 1), "comm_share"].iloc[0] == pytest.approx(4 / 50)


def test_scaling_tables():
    runs = {"w2": make_log(2, 6), "w8": make_log(8, 6)}
    table = analysis.scaling(runs)
    # steps 0 (set-up) and 5 (not timed: no next step) are left out of the steady state
    assert table["world_size"].tolist() == [2, 8] and table["steps"].tolist() == [4, 4]
    assert (table["comm_per_step_us"] > 0).all() and table["comm_share"].between(0, 1).all()
    t = table["step_us"].to_numpy()
    assert table["efficiency"].tolist() == pytest.approx([1.0, t[0] / t[1]])  # weak: T(N0) / T(N)
    assert table["speedup"].tolist() == pytest.approx([1.0, 4 * t[0] / t[1]])
    strong = analysis.scaling(runs, mode="strong", global_batch=64)
    assert strong["speedup"].tolist() == pytest.approx([1.0, t[0] / t[1]])
    assert strong["efficiency"].tolist() == pytest.approx([1.0, t[0] / t[1] / 4])
    assert strong["samples_per_s"].tolist() == pytest.approx(64e6 / t)
    weak = analysis.scaling(runs, global_batch=64)
    assert weak["samples_per_s"].tolist() == pytest.approx([64e6 / t[0], 4 * 64e6 / t[1]])
    by_op = analysis.scaling_by_op(runs)
    assert set(by_op["collective"]) == {"all_reduce", "all_gather", "broadcast", "reduce_scatter"}
    # counts per rank, not summed over ranks: the same job issues the same calls at both sizes
    per_rank = by_op.groupby(["collective", "size_bucket", "world_size"])["calls_per_rank"].sum().unstack()
    assert (per_rank[2] == per_rank[8]).all()


def test_steps_stages_setup_and_ddp_exposure():
    """Step 0 is set-up, DDP's bucket rebuild is set-up wherever it falls; the exposed time of DDP's
    gradient buckets runs from the last bucket's issue to the end of the last one, or to the end of
    DDP's finalize where it is noted (sync_end_us, step 3)."""
    t0 = 1_700_000_000_000_000_000
    us = 1000
    rows = [dict(rank=0, step=0, op="ddp_verify_params", start_ns=t0, duration_us=50.0, group_size=2)]
    for step in range(1, 5):
        base = t0 + step * 1000 * us
        rows += [  # buckets issued at 100 and 300 us, ending at 350 and 500: exposed 300..500 = 200 us
            dict(
                rank=0,
                step=step,
                op="ddp_bucket_allreduce",
                start_ns=base + 100 * us,
                duration_us=250.0,
                async_op=True,
                timing="future",
                bucket=1,
                group_size=2,
                bytes=4000,
            ),
            dict(
                rank=0,
                step=step,
                op="ddp_bucket_allreduce",
                start_ns=base + 300 * us,
                duration_us=200.0,
                async_op=True,
                timing="future",
                bucket=0,
                group_size=2,
                bytes=4000,
                sync_end_us=280.0 if step == 3 else np.nan,
            ),
        ]  # step 3: the finalize ends at 580 us
        if step == 1:
            rows.append(dict(rank=0, step=1, op="ddp_rebuild_buckets", start_ns=base, duration_us=30.0, group_size=2))
    ps = analysis.per_step(frame(rows), by_rank=False)
    assert ps["stage"].tolist() == ["setup", "steady", "steady", "steady", "end"]
    two = ps[ps["step"] == 2].iloc[0]
    assert two["exposed_us"] == pytest.approx(200.0) and two["busy_us"] == pytest.approx(400.0)
    assert two["overlapped_us"] == pytest.approx(200.0) and two["overlap_unknown_us"] == 0.0
    assert two["step_us"] == pytest.approx(1000.0) and two["exposed_share"] == pytest.approx(0.2)
    assert two["ddp_finalize_us"] == 0.0
    three = ps[ps["step"] == 3].iloc[0]
    assert three["ddp_finalize_us"] == pytest.approx(80.0) and three["exposed_us"] == pytest.approx(280.0)
    assert three["busy_us"] == pytest.approx(480.0) and three["comm_us"] == pytest.approx(450.0)
    assert three["overlapped_us"] == pytest.approx(200.0) and three["comm_share"] == pytest.approx(0.48)
    st = analysis.steady_state(ps)
    # exposed shares 230/1100 (step 1: the blocking rebuild first), 0.2, 0.28: the median is step 1's
    assert st["steps"] == 3 and st["step_p50_us"] == pytest.approx(1000.0)
    assert st["exposed_share"] == pytest.approx(230 / 1100) and st["ddp_finalize_us"] == 0.0
    setup = analysis.setup_cost(frame(rows), ps)
    assert setup["setup_comm_us"] == pytest.approx(80.0) and setup["by_op"]["ddp_verify_params"] == 50.0
    assert setup["setup_us"] == pytest.approx(1000.0)  # step 0's first call to step 1's first call


def test_ddp_packing_is_exposed_and_busy_where_alone():
    """DDP's packing of gradients into buckets (pack_us on the bucket rows): the training thread's
    own time, so exposed; busy for the part with no bucket in flight (pack_alone_us)."""
    t0 = 1_700_000_000_000_000_000
    us = 1000
    rows = []
    for step in range(3):
        base = t0 + step * 1000 * us
        rows += [  # as above: busy 400 us, exposed 200 us without the packing
            dict(
                rank=0,
                step=step,
                op="ddp_bucket_allreduce",
                start_ns=base + 100 * us,
                duration_us=250.0,
                async_op=True,
                timing="future",
                bucket=1,
                group_size=2,
                bytes=4000,
                pack_us=60.0,
                pack_alone_us=60.0,
            ),
            dict(
                rank=0,
                step=step,
                op="ddp_bucket_allreduce",
                start_ns=base + 300 * us,
                duration_us=200.0,
                async_op=True,
                timing="future",
                bucket=0,
                group_size=2,
                bytes=4000,
                pack_us=40.0,
                pack_alone_us=10.0,
            ),
        ]
    one = analysis.per_step(frame(rows), by_rank=False).set_index("step").loc[1]
    assert one["ddp_pack_us"] == pytest.approx(100.0)
    assert one["busy_us"] == pytest.approx(470.0) and one["exposed_us"] == pytest.approx(300.0)
    assert one["overlapped_us"] == pytest.approx(170.0) and one["comm_us"] == pytest.approx(450.0)
    assert one["comm_share"] == pytest.approx(0.47) and one["exposed_share"] == pytest.approx(0.3)
    assert analysis.steady_state(analysis.per_step(frame(rows)))["ddp_pack_us"] == pytest.approx(100.0)


def test_bandwidth_from_the_transfer_time_not_the_wait_for_late_ranks():
    """Issue 23.5: a rank that issued first waits for the last one; that wait is not transfer. The
    synthetic log moves data at 5 GB/s plus 20 us of latency; rank 2 issues every call 2 ms late."""
    df = make_log(4, 6, straggler=2, bandwidth_gbps=5.0)
    cross = analysis.cross_rank(df)
    transfer = analysis.transfer_times(df, None)
    assert np.array_equal(cross.transfer_us, transfer, equal_nan=True)
    own = df["own_us"].to_numpy()
    assert (transfer <= own + 1e-9).all()
    late = df["rank"].to_numpy() == 2
    np.testing.assert_allclose(transfer[late], own[late])  # the last rank waited for no one
    coll = ~df["op"].isin(analysis.P2P_OPS).to_numpy()
    assert (own[~late & coll] - transfer[~late & coll] > 1500).all()  # the others waited ~2 ms for it
    s = analysis.summary(analysis.with_transfer(df, cross), by=["collective", "size_bucket"])
    big = s[(s["collective"] == "all_reduce") & (s["size_bucket"] > 1e6)].iloc[0]
    expected = big["bytes"] / 4 / 6 / (big["bytes"] / 4 / 6 / 5e3 + 20.0) / 1e3  # GB/s of one call
    assert big["algbw_gbps"] == pytest.approx(expected, rel=1e-6)
    assert big["busbw_with_wait_gbps"] < 0.6 * big["busbw_gbps"]
    # one rank's log alone: no cross-rank arrival, the per-rank figure
    one = df[df["rank"] == 0].reset_index(drop=True)
    np.testing.assert_allclose(analysis.transfer_times(one), one["own_us"].to_numpy())
    # a group with a member's log missing: the own time
    three = df[df["rank"] != 2].reset_index(drop=True)
    np.testing.assert_allclose(analysis.transfer_times(three), three["own_us"].to_numpy())


def test_the_array_helpers_equal_numpy_and_pandas():
    """arrays.lexsort skips the sort of rows in order already, arrays.running_max replaces a pandas
    group-by cummax, hangs._counts a pandas group-by size: each equal to what it replaces, on random
    keys with ties, NaN and infinities (and the counts' fallback for keys too many for one integer)."""
    from commpatch.analysis import hangs
    from commpatch.analysis.arrays import lexsort, running_max

    rng = np.random.default_rng(7)
    for trial in range(2000):
        n = int(rng.integers(0, 60))
        keys = []
        for _ in range(int(rng.integers(1, 4))):
            key = rng.integers(0, 4, n) if rng.random() < 0.5 else rng.normal(size=n).round(1)
            if key.dtype.kind == "f" and n and rng.random() < 0.2:
                key[rng.integers(0, n)] = np.nan
            keys.append(np.sort(key) if rng.random() < 0.3 else key)
        if rng.random() < 0.4:  # rows in order already
            order = np.lexsort(keys)
            keys = [k[order] for k in keys]
        assert np.array_equal(lexsort(keys), np.lexsort(keys)), trial
        groups = np.sort(rng.integers(0, 8, n)) + int(rng.integers(0, 10**6))
        values = rng.normal(size=n) * rng.choice([1.0, 1e9])
        values[rng.random(n) < 0.1] = np.nan
        values[rng.random(n) < 0.05] = rng.choice([np.inf, -np.inf])
        expected = pd.Series(values).groupby(groups).cummax().to_numpy() if n else np.zeros(0)
        kept = ~np.isnan(values)  # (pandas keeps a NaN there; the maximum before it is kept here)
        assert np.array_equal(running_max(values, groups)[kept], expected[kept]), trial
    rank = rng.integers(0, 5, 500) * 7
    group, op, peer = rng.integers(0, 3, 500), rng.integers(0, 4, 500), rng.integers(-1, 6, 500)
    ranks, at = np.unique(rank, return_inverse=True)
    names = np.array(["g0", "g1", "g2"], object), np.array(["a", "b", "c", "d"], object)
    counts = hangs._counts(ranks, at, group, op, peer, *names)
    table = (
        pd.DataFrame({"rank": rank, "group": group, "op": op, "peer": peer})
        .groupby(["rank", "group", "op", "peer"], sort=True)
        .size()
    )
    assert counts["n"].tolist() == table.tolist()
    assert counts["rank"].tolist() == table.index.get_level_values("rank").tolist()
    assert counts["group"].tolist() == names[0][table.index.get_level_values("group")].tolist()
    assert counts["op"].tolist() == names[1][table.index.get_level_values("op")].tolist()
    assert counts["peer"].tolist() == table.index.get_level_values("peer").tolist()
    wide = hangs._counts(ranks, at, group, op, peer - 1, *names)  # a peer below -1: the group-by
    assert wide["peer"].tolist() == (counts["peer"] - 1).tolist() and wide["n"].tolist() == counts["n"].tolist()
    missing = hangs._counts(ranks, at, group - 1, op, peer, *names)  # a missing group's code -1: the group-by
    assert missing["n"].tolist() == counts["n"].tolist() and missing["peer"].tolist() == counts["peer"].tolist()


def test_the_last_rows_of_rows_in_order_are_those_a_sort_finds():
    """hangs._last_rows hashes the keys of rows in (rank, seq) order instead of sorting them: the same
    rows, with ties in seq and a selection."""
    from commpatch.analysis import hangs
    from commpatch.analysis.arrays import in_order

    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(1, 200))
        rank = np.sort(rng.integers(0, 4, n))
        seq = np.concatenate([np.sort(rng.integers(0, 50, int((rank == r).sum()))) for r in np.unique(rank)])
        group, op, peer = rng.integers(0, 3, n), rng.integers(0, 3, n), rng.integers(-1, 3, n)
        sel = rng.random(n) < 0.5
        assert in_order((seq, rank))
        for keys, s in (((rank,), None), ((rank, group, op > 0), None), ((rank, group, op, peer), sel)):
            assert sorted(hangs._last_rows(keys, seq, s, ordered=True)) == sorted(hangs._last_rows(keys, seq, s)), trial
