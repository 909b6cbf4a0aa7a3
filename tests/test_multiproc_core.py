"""Core behaviour that needs real peers: threads, coalescing, torch's errors, subgroups."""

import numpy as np
import pytest

from tests import workers
from tests.multiproc import run_ranks
from tests.torch_compat import leaf


def test_two_threads_on_separate_groups_lose_and_duplicate_nothing():
    calls = 200
    for df in run_ranks(workers.two_threads, 2, timeout=120, calls=calls):
        assert len(df) == 2 * calls and df["seq"].is_unique
        per_group = df.groupby("group", observed=True)
        assert sorted(per_group.size().tolist()) == [calls, calls]
        for _, g in per_group:
            assert (np.diff(g["group_seq"].to_numpy()) == 1).all() and g["group_seq"].iloc[0] == 0
        assert df["status"].eq("ok").all()


@pytest.fixture(scope="module")
def coalescing_run():
    return run_ranks(workers.coalescing, 2, timeout=90)


# scenario -> (rows: (op, bytes, tensors coalesced, timing), gloo ops the profiler saw); world 2, 4 floats
COALESCED = {
    "all_reduce_sync": ([("coalesced.all_reduce", 3 * 16, 3, "host")], {"all_reduce": 1}),
    "all_reduce_async": ([("coalesced.all_reduce", 3 * 16, 3, "future")], {"all_reduce": 1}),
    "all_gather": ([(f"coalesced.{leaf('all_gather_into_tensor')}", 2 * 32, 2, "host")], {"all_gather": 1}),
    # gloo runs a coalesced reduce_scatter as one all_reduce per tensor, with no future
    "reduce_scatter_async": ([(f"coalesced.{leaf('reduce_scatter_tensor')}", 2 * 32, 2, "none")], {"all_reduce": 2}),
    "with_a_broadcast": (
        [("broadcast", 8, 1, "host"), ("coalesced.all_reduce", 16, 1, "host")],
        {"broadcast": 1, "all_reduce": 1},
    ),
}


@pytest.mark.parametrize("scenario", sorted(COALESCED))
def test_coalescing_manager_recorded_once_as_what_ran(coalescing_run, scenario):
    rows, witness = COALESCED[scenario]
    for out, errors in coalescing_run:
        df, seen, ok = out[scenario]
        assert ok, "the coalesced collective gave a wrong result"
        assert seen == witness
        got = list(zip(df["op"].astype(str), df["bytes"], df["tensors"], df["timing"].astype(str)))
        assert got == rows and (df["bucket_params"] == 0).all()
        assert (df["status"] == "ok").all() and not errors
        measured = df[df["timing"] != "none"]
        assert (measured["duration_us"] > 0).all()
        coalesced = df[df["op"].str.startswith("coalesced.")]
        assert (coalesced["async_op"] == scenario.endswith("_async")).all()


def test_coalescing_manager_bound_before_enable_keeps_a_row_per_queued_call(coalescing_run):
    """Documented limit: a manager imported by name before enable() is not wrapped; each queued
    call keeps a row of its own, with no duration (the real collective runs at the exit)."""
    for out, _ in coalescing_run:
        df, seen, ok = out["bound_early"]
        assert ok and seen == {"all_reduce": 1}
        assert list(df["op"]) == ["all_reduce"] * 3 and (df["timing"] == "none").all()


def test_torch_errors_propagate_unchanged_with_an_error_row():
    for results, df in run_ranks(workers.errors_propagate, 2, timeout=90):
        assert results[True] == results[False], "the patched call raised something else"
        assert df["status"].tolist() == ["error"] and df["op"].tolist() == ["all_gather_into_tensor"]


def test_non_members_record_nothing_for_the_subgroup():
    dfs = run_ranks(workers.non_member, 4, timeout=120)
    for rank, df in enumerate(dfs):
        sizes = df["group_size"].tolist()
        assert sizes == ([2, 4] if rank < 2 else [4]), (rank, sizes)
