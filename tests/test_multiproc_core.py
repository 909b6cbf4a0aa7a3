"""Core behaviour that needs real peers: threads, coalescing, torch's errors, subgroups."""

import numpy as np

from tests import workers
from tests.multiproc import run_ranks


def test_two_threads_on_separate_groups_lose_and_duplicate_nothing():
    calls = 200
    for df in run_ranks(workers.two_threads, 2, timeout=120, calls=calls):
        assert len(df) == 2 * calls and df["seq"].is_unique
        per_group = df.groupby("group", observed=True)
        assert sorted(per_group.size().tolist()) == [calls, calls]
        for _, g in per_group:
            assert (np.diff(g["group_seq"].to_numpy()) == 1).all() and g["group_seq"].iloc[0] == 0
        assert df["status"].eq("ok").all()


def test_coalescing_manager_runs_and_is_not_broken():
    for df, values, expected in run_ranks(workers.coalescing, 2, timeout=90):
        assert values == [expected] * 3, "the coalesced all_reduce gave a wrong result"
        assert len(df) == 6 and df["op"].eq("all_reduce").all()
        # the real collective runs when the manager exits: these rows have no duration of their own
        assert df["timing"].eq("none").all()


def test_torch_errors_propagate_unchanged_with_an_error_row():
    for results, df in run_ranks(workers.errors_propagate, 2, timeout=90):
        assert results[True] == results[False], "the patched call raised something else"
        assert df["status"].tolist() == ["error"] and df["op"].tolist() == ["all_gather_into_tensor"]


def test_non_members_record_nothing_for_the_subgroup():
    dfs = run_ranks(workers.non_member, 4, timeout=120)
    for rank, df in enumerate(dfs):
        sizes = df["group_size"].tolist()
        assert sizes == ([2, 4] if rank < 2 else [4]), (rank, sizes)
