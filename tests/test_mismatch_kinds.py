"""Mismatch kinds are one enum (``analysis.MismatchKind``): every kind the pandas path and the
DuckDB engine produce is a member, on logs where all six happen (docs/reporting.md's list is
checked against the same enum in tests/test_docs.py); a kind writes as its value."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from commpatch import io as cpio
from commpatch.analysis import MismatchKind, cross_rank, engine
from commpatch.analysis.matching import mismatch_table
from commpatch.testing import make_log

ALL = {k.value for k in MismatchKind}


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    """Per-rank CSV logs with each kind of mismatch: a lost receive (an op mismatch and an
    unmatched send), a dtype, a size, a send whose receive expects another size, a skipped
    collective (missing)."""
    directory = tmp_path_factory.mktemp("kinds")
    df = make_log(4, 5, p2p=True, missing=(3, 6), seed=1)
    df.loc[(df["rank"] == 1) & (df["op"] == "recv") & (df["step"] == 2), "op"] = "broadcast"
    df.loc[(df["rank"] == 0) & (df["seq"] == 3), "dtype"] = "bfloat16"
    df.loc[(df["rank"] == 2) & (df["seq"] == 4), "bytes"] *= 2
    df.loc[df.index[(df["op"] == "send") & (df["step"] == 3)][:1], "bytes"] += 4
    extra = df[(df["seq"] == 3) & (df["rank"] < 3)].assign(group="g", group_seq=0, seq=10_000)
    df = pd.concat([df.astype({"group": str}), extra.astype({"group": str})], ignore_index=True)
    for rank, part in df.groupby("rank"):
        cpio.write(part, str(directory / f"rank{rank}.csv"))
    return str(directory)


def test_the_pandas_path_produces_every_kind_and_only_members(every_kind):
    kinds = cross_rank(cpio.read(every_kind)).mismatches["kind"].tolist()
    assert set(kinds) == ALL
    assert all(type(k) is str and MismatchKind(k).value == k for k in kinds)  # plain strings in the table


@pytest.mark.skipif(not engine.available(), reason="needs duckdb (commpatch[scale])")
def test_the_duckdb_engine_produces_every_kind_and_only_members(every_kind):
    import functools

    from commpatch.analysis import REPORT_COLUMNS

    by = ["collective", "size_bucket"]
    with engine.Engine(by=by) as eng:
        stage = functools.partial(engine.stage, directory=eng.directory, by=by)
        for staged in cpio.read_ranks(every_kind, stage, columns=set(REPORT_COLUMNS) | {"collective"}):
            eng.add(staged)
        kinds = eng.results(arrivals_bins=200).mismatches["kind"].tolist()
    assert set(kinds) == ALL
    assert all(type(k) is str and MismatchKind(k).value == k for k in kinds)


def test_a_kind_is_written_as_its_value():
    kind = MismatchKind.P2P_UNMATCHED
    assert (str(kind), f"{kind}", f"{kind:>15}", json.dumps([kind])) == (
        "p2p_unmatched",
        "p2p_unmatched",
        "  p2p_unmatched",
        '["p2p_unmatched"]',
    )
    assert kind == "p2p_unmatched" and {"p2p_unmatched": 1}[kind] == 1


def test_a_kind_outside_the_enum_is_refused():
    with pytest.raises(ValueError, match="'torn'"):
        mismatch_table([("torn", "0", 1, 0, "all_reduce", 1)], lambda g, c: None, [], set())
