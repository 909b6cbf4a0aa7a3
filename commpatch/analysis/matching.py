"""Cross-rank analysis: read every rank's file, match the same collective across ranks, and
report arrival skew, stragglers, time spent waiting for peers, and mismatches.

Matching rule. A collective is identified by its group and its *collective sequence number*
``coll_seq``: the log's ``group_seq`` minus the point-to-point calls this rank made on that
group before it. Point-to-point ops (``P2P_OPS``) involve two ranks only, so they advance
``group_seq`` on those two ranks and not on the others; leaving them in would misalign every
later collective. They are matched separately, pairwise: the k-th send (send, isend) from
rank a to rank b on a group with the k-th receive (recv, irecv) of rank b from rank a, and
``send_object_list`` with ``recv_object_list`` likewise. ``batch_isend_irecv`` rows carry no
peer and are left out of both matchings. Receives from any source (peer -1) are left out too.

Everything here is DataFrame -> DataFrame (or a small bundle of DataFrames); nothing prints.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.attrs import shared
from ..data.clock import CLOCK_ATTR
from ..data.ops import P2P_OPS
from ..data.schema import expand_ranks
from .arrays import lexsort
from .stragglers import position_arrivals, step_arrivals
from .summaries import HOST_CLOCK_NAMES, durations, own_durations


class MismatchKind(str, enum.Enum):
    """What differs in a mismatch (the ``kind`` column of ``mismatches``; docs/reporting.md lists
    them). A ``str``: a kind is written, compared and hashed as its value."""

    OP = "op"  # the same collective is a different op on some ranks
    DTYPE = "dtype"  # same op, different element type
    BYTES = "bytes"  # same op, different message size
    MISSING = "missing"  # a member rank with a log never recorded the collective
    P2P_UNMATCHED = "p2p_unmatched"  # a send without its receive, or the reverse
    P2P_BYTES = "p2p_bytes"  # a send and its receive disagree on the size

    def __str__(self) -> str:  # the value, on every Python (not "MismatchKind.OP")
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


# p2p op -> (direction, channel): sends pair with receives of the same channel
P2P_SIDES = {
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
    "send_object_list": ("send", "object"),
    "recv_object_list": ("recv", "object"),
}


# ---- matching ---------------------------------------------------------------------------
def _runs(*sorted_keys):
    """First/last positions of runs of equal values in already sorted key arrays."""
    n = len(sorted_keys[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.zeros(n, bool)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    first = np.flatnonzero(change)
    last = np.append(first[1:] - 1, n - 1)
    return first, last


def collective_seq(df):
    """Per row: the collective sequence number within (rank, group), p2p calls left out (-1 for them)."""
    p2p = df["op"].isin(P2P_OPS).to_numpy()
    rank = df["rank"].to_numpy()
    group = (
        df["group"].cat.codes.to_numpy()
        if hasattr(df["group"], "cat")
        else df["group"].astype("category").cat.codes.to_numpy()
    )
    gseq = df["group_seq"].to_numpy()
    order = lexsort((gseq, group, rank))
    first, last = _runs(rank[order], group[order])
    cum = np.cumsum(p2p[order])
    base = np.repeat(np.append(0, cum)[first], last - first + 1)  # p2p calls before the run
    before = cum - p2p[order] - base  # p2p calls before this row
    out = np.empty(len(df), np.int64)
    out[order] = np.where(p2p[order], -1, gseq[order] - before)
    return out


def _present_ranks(df) -> np.ndarray:
    return np.unique(df["rank"].to_numpy())


def _expected(group_ranks, present) -> dict[str, frozenset]:
    """group_ranks string -> the ranks of that group that have a log here."""
    present = set(present.tolist())
    return {s: frozenset(r for r in expand_ranks(s) if r in present) for s in group_ranks}


def match_collectives(df):
    """One row per collective (group, coll_seq) matched across ranks; p2p ops left out.

    Columns: group, coll_seq, op, dtype, bytes (of the earliest rank), step, ranks (how many
    ranks recorded it), expected_ranks (members of the group that have a log here reaching it:
    more collectives of the group, or none while the log goes on), first_start_ns, last_start_ns,
    skew_us (latest minus earliest issue time), straggler (the rank that issued it last),
    mean_duration_us, max_duration_us, op_mismatch, dtype_mismatch, bytes_mismatch, missing
    (ranks < expected_ranks), ended (members with a log here that ends before it: not missing).
    """
    return _match(df)[0]


def _match(df):
    """(collectives table, per-row waits, the collective rows, their coll_seq): shared by the
    functions of this module so that ``cross_rank`` matches only once."""
    import pandas as pd

    cseq = collective_seq(df)
    keep = cseq >= 0
    sub = df[keep]
    cseq = cseq[keep]
    group = sub["group"].cat.codes.to_numpy().astype(np.int64)
    start = sub["start_ns"].to_numpy()
    rank = sub["rank"].to_numpy()
    order = lexsort((rank, start, cseq, group))
    first, last = _runs(group[order], cseq[order])
    size = last - first + 1
    run_of = np.repeat(np.arange(len(first)), size)  # sorted row -> collective
    f_rows, l_rows = order[first], order[last]

    def differs(codes):
        codes = codes[order]
        return (
            np.maximum.reduceat((codes != codes[first][run_of]).astype(np.int8), first).astype(bool)
            if len(first)
            else np.zeros(0, bool)
        )

    op_codes = sub["op"].cat.codes.to_numpy()
    dtype_codes = sub["dtype"].cat.codes.to_numpy()
    nbytes = sub["bytes"].to_numpy()
    duration = durations(sub)
    dur_sorted = duration[order]
    with np.errstate(invalid="ignore"):
        total_dur = np.add.reduceat(np.nan_to_num(dur_sorted), first) if len(first) else np.zeros(0)
        measured = np.add.reduceat((~np.isnan(dur_sorted)).astype(np.int64), first) if len(first) else np.zeros(0)
        max_dur = np.fmax.reduceat(dur_sorted, first) if len(first) else np.zeros(0)
    ranks_cat = sub["group_ranks"]
    # the members whose log reaches each collective: a log that ends early (a torn tail, a write
    # failure, a rank that stopped) ends the matching of its rank there, it does not make mismatches
    counts, alive = log_ends(df, sub, cseq, group, rank)
    present = _expected(ranks_cat.cat.categories, _present_ranks(df))
    members = {code: sorted(present[s]) for code, s in enumerate(ranks_cat.cat.categories)}
    g_first, c_first = group[f_rows], cseq[f_rows]
    gr_first = ranks_cat.cat.codes.to_numpy()[f_rows] if len(first) else np.zeros(0, np.int64)
    expected = np.zeros(len(first), np.int64)
    present_n = np.zeros(len(first), np.int64)
    by_group = counts_by_group(counts)
    pair = g_first * (len(ranks_cat.cat.categories) + 1) + gr_first
    order_pairs = np.argsort(pair, kind="stable")
    bounds = np.flatnonzero(np.diff(pair[order_pairs])) + 1
    for at in np.split(order_pairs, bounds) if len(first) else ():
        code, grc = int(g_first[at[0]]), int(gr_first[at[0]])
        steps = reach_steps(members[grc], by_group.get(code, {}), alive.get(code, ()))
        los = np.array([lo for lo, _ in steps])
        expected[at] = np.array([n for _, n in steps])[np.searchsorted(los, c_first[at], side="right") - 1]
        present_n[at] = len(members[grc])
    table = pd.DataFrame(
        {
            "group": sub["group"].iloc[f_rows].to_numpy(),
            "coll_seq": cseq[f_rows],
            "op": sub["op"].iloc[f_rows].to_numpy(),
            "dtype": sub["dtype"].iloc[f_rows].to_numpy(),
            "bytes": nbytes[f_rows],
            "step": sub["step"].to_numpy()[f_rows],
            "ranks": size,
            "expected_ranks": expected,
            "first_start_ns": start[f_rows],
            "last_start_ns": start[l_rows],
            "skew_us": (start[l_rows] - start[f_rows]) / 1e3,
            "straggler": rank[l_rows],
            "mean_duration_us": np.where(measured > 0, total_dur / np.maximum(measured, 1), np.nan),
            "max_duration_us": max_dur,
            "op_mismatch": differs(op_codes),
            "dtype_mismatch": differs(dtype_codes),
            "bytes_mismatch": differs(nbytes),
        }
    )
    table["missing"] = table["ranks"] < table["expected_ranks"]
    table["ended"] = present_n - table["expected_ranks"].to_numpy()  # members whose log ended before it
    table.attrs["log_ends"] = shared(counts)
    table.attrs["group_names"] = shared(dict(enumerate(str(c) for c in sub["group"].cat.categories)))
    # time each rank waited for the last arrival, bounded by the call's own measured duration
    wait, skew, arrival, coll = np.empty(len(sub)), np.empty(len(sub)), np.empty(len(sub)), np.empty(len(sub), np.int64)
    wait[order] = (start[l_rows][run_of] - start[order]) / 1e3
    arrival[order] = (start[order] - start[f_rows][run_of]) / 1e3
    skew[order] = table["skew_us"].to_numpy()[run_of]
    coll[order] = run_of
    last = np.zeros(len(sub), bool)
    last[l_rows[size > 1]] = True
    # each row's issue time minus the latest other rank's of its collective (the straggler's evidence:
    # positive only for the last rank, by how long it alone held the collective up); NaN alone
    multi = size > 1
    latest_other = np.repeat(start[l_rows], size)  # in sorted order
    second = (first + size - 1)[multi] - 1  # sorted position of the second-latest arrival
    latest_other[second + 1] = start[order[second]]
    late = np.full(len(sub), np.nan)
    late[order] = np.where(np.repeat(multi, size), (start[order] - latest_other) / 1e3, np.nan)
    # less what its later release by its last blocking rooted collective explains (the root of a reduce)
    late = late_released(late, l_rows[multi], order[second], *releases(sub, cseq, group))
    # the arrival-free transfer time: from the last rank's issue (or the end of the row's queueing
    # behind earlier calls of its group, when later) to the row's completion; only where every
    # member of the group has a log here and the row's duration is on the host's clock
    own = own_durations(sub)
    after_last = np.full(len(sub), np.nan)
    after_last[order] = (start[order] - start[l_rows][run_of]) / 1e3 + duration[order]
    group_size = np.array([len(expand_ranks(s)) for s in ranks_cat.cat.categories] or [0], np.int64)
    complete = (size == group_size[gr_first]) if len(first) else np.zeros(0, bool)
    host_clock = sub["timing"].isin(HOST_CLOCK_NAMES).to_numpy()
    known = np.zeros(len(sub), bool)
    known[order] = complete[run_of]
    known &= host_clock & (after_last > 0)
    transfer = np.where(known, np.fmin(own, after_last), own)
    waits = pd.DataFrame(
        {
            "rank": rank,
            "collective": coll,
            "arrival_us": arrival,
            "late_us": late,
            "start_ns": start,
            "wait_us": np.minimum(wait, duration),
            "duration_us": duration,
            "last": last,
            "skew_us": skew,
            "step": sub["step"].to_numpy(),
            "ranks": size[coll] if len(coll) else np.zeros(0, np.int64),
            "transfer_us": transfer,
        }
    )
    return table, waits, sub, cseq


def releases(df, cseq, group):
    """Per row of ``df``: when its rank was last released by a rooted collective (``cseq`` >= 0, a
    root: reduce, gather, scatter, broadcast and their object forms) that held the host until it
    completed (a sync call whose time in the call, ``host_us``, covers its duration: gloo's calls;
    not an async call, nor a sync one that returned while its device work went on), issued before
    the row in its step or the step before, and that collective's key (``group`` code << 32 |
    cseq): (release ns, key, known). The root of a reduce receives and adds while the others only
    send: it leaves last by the collective's own design and issues what follows later, the async
    calls after it too, without more work of its own; ``late_released`` takes that out of the
    straggler's evidence. A symmetric collective's (all-reduce, all-gather, barrier) release skew
    stays in: there it is the ranks' own noise (taken out, it lowered the noise threshold below
    what symmetric FSDP2 jobs on CPU hold each other up by: one of six named)."""
    n = len(df)
    rel, key, known = np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, bool)
    if not n or "host_us" not in df.columns or "async_op" not in df.columns:
        return rel, key, known
    host = df["host_us"].to_numpy(np.float64)
    duration = durations(df)
    sync = ~df["async_op"].to_numpy(bool)
    rank, seq, start = df["rank"].to_numpy(np.int64), df["seq"].to_numpy(np.int64), df["start_ns"].to_numpy(np.int64)
    step = df["step"].to_numpy(np.int64)
    idx = np.flatnonzero(cseq >= 0)
    o = idx[lexsort((seq[idx], rank[idx]))]  # each rank's collectives in issue order
    if len(o) < 2:
        return rel, key, known
    rooted = df["peer"].to_numpy(np.int64) >= 0 if "peer" in df.columns else np.zeros(n, bool)
    with np.errstate(invalid="ignore"):
        held = sync[o] & rooted[o] & (host[o] >= duration[o])  # NaN (unknown) compares False
    # the last held position strictly before each position (-1: none)
    at = np.maximum.accumulate(np.where(held, np.arange(len(o)), -1))
    prev = np.concatenate(([-1], at[:-1]))
    p = o[np.maximum(prev, 0)]
    ok = (prev >= 0) & (rank[p] == rank[o]) & (step[p] >= step[o] - 1)
    rel[o] = start[p] + np.nan_to_num(host[p] * 1e3).astype(np.int64)
    key[o] = np.where(ok, (group[p].astype(np.int64) << 32) | cseq[p], -1)
    known[o] = ok
    return rel, key, known


def late_released(late_us, last, other, rel, key, known) -> np.ndarray:
    """``late_us`` of the rows ``last`` (the last rank of their collective) less how much later their
    rank was released by its last blocking rooted collective than the latest other rank (rows
    ``other``) was by the same one (``releases``), never below 0 nor above what the others waited."""
    both = known[last] & known[other] & (key[last] == key[other]) & (key[last] >= 0)
    skew = np.where(both, (rel[last] - rel[other]) / 1e3, 0.0)
    out = late_us.copy()
    out[last] = np.maximum(late_us[last] - np.maximum(skew, 0.0), 0.0)
    return out


def log_ends(df, sub, cseq, group, rank):
    """({(group code, rank): collectives of the rank on the group}, {group code: members with no
    collective on it whose log goes on after the group's first collective was issued: they never
    took part, a mismatch}); ``sub`` the collective rows of ``df``, ``cseq`` / ``group`` / ``rank``
    their columns as arrays."""
    import pandas as pd

    if not len(sub):
        return {}, {}
    per = pd.DataFrame({"g": group, "r": rank, "c": cseq}).groupby(["g", "r"])["c"].max() + 1
    counts = {(int(g), int(r)): int(c) for (g, r), c in per.items()}
    last_ns = df.groupby("rank")["start_ns"].max()
    first_ns = pd.Series(sub["start_ns"].to_numpy()).groupby(group).min()
    alive = {int(g): {int(r) for r, end in last_ns.items() if end > t} for g, t in first_ns.items()}
    return counts, alive


def log_end_table(collectives):
    """Per group whose members' logs end at different points (``_match``): the ranks whose log ends
    before the group's last collective (each with its last collective: '1 (#14), 2 (#22)'), the
    last collective of the shortest, the group's last, and how many collectives after the shortest
    end are matched over fewer ranks. Columns: group, ranks, last_coll_seq, group_last, unmatched."""
    by_group = counts_by_group(collectives.attrs.get("log_ends", {}))
    codes = {name: code for code, name in collectives.attrs.get("group_names", {}).items()}
    tail = collectives[collectives["ended"] > 0]
    parts = tail.groupby("group", observed=True, sort=True)["coll_seq"].agg(["max", "size"])
    return log_end_rows(
        [
            (
                str(group),
                by_group.get(codes.get(str(group)), {}),
                int(row["max"]),
                int(row["size"]),
            )
            for group, row in parts.iterrows()
        ]
    )


def log_end_rows(groups):
    """``log_end_table`` from (group name, {rank: its collectives on the group}, the group's last
    collective, collectives matched over fewer ranks) per group; shared with the engine."""
    import pandas as pd

    rows = []
    for group, counts, last, unmatched in groups:
        short = sorted((n, r) for r, n in counts.items() if n <= last)
        shown = ", ".join(f"{r} (#{n})" for n, r in short[:8]) + (
            f", ... ({len(short)} ranks)" if len(short) > 8 else ""
        )
        rows.append(
            dict(
                group=group,
                ranks=shown,
                last_coll_seq=short[0][0] - 1 if short else -1,
                group_last=last,
                unmatched=unmatched,
            )
        )
    return pd.DataFrame(rows, columns=["group", "ranks", "last_coll_seq", "group_last", "unmatched"])


def counts_by_group(counts) -> dict:
    """``log_ends``' counts as {group code: {rank: collectives}}: gathered once (a scan of every
    (group, rank) per group is quadratic in the groups: issue 33)."""
    out: dict = {}
    for (g, r), n in counts.items():
        out.setdefault(g, {})[r] = n
    return out


def reach_steps(members, counts, alive):
    """[(first cseq, members expected from it on)] for one group: a member is expected in collective
    c when its log holds more than c collectives of the group, or holds none and goes on after the
    group's first collective (``alive``: it never took part). Piecewise constant in c."""
    reach = np.sort([counts.get(r, np.inf if r in alive else 0) for r in members])
    out = [(0, int(np.sum(reach > 0)))]
    for k in np.unique(reach[np.isfinite(reach) & (reach > 0)]):
        out.append((int(k), int(np.sum(reach > k))))
    return out


def rank_table(df, matched=None):
    """Per rank: how often and by how much it arrived last, and its time spent waiting.

    Columns: rank, collectives, last_count (collectives of two or more ranks it issued last),
    last_share, late_us (sum of the skew of the collectives it was last in), wait_us (sum over
    its collectives of latest arrival minus its own, bounded by the measured duration),
    measured_us (sum of its measured durations), wait_share (wait_us / measured_us).
    Sorted by late_us then last_count: the rank that held the others up longest comes first
    (being last by a few microseconds is noise; being last by milliseconds is a straggler).
    """
    waits = (matched or _match(df))[1]
    w = waits.assign(late_us=np.where(waits["last"], waits["skew_us"], 0.0), measured=~np.isnan(waits["duration_us"]))
    w["wait_us"] = w["wait_us"].where(w["measured"])
    out = w.groupby("rank").agg(
        collectives=("wait_us", "size"),
        last_count=("last", "sum"),
        late_us=("late_us", "sum"),
        wait_us=("wait_us", "sum"),
        measured_us=("duration_us", "sum"),
    )
    out["last_share"] = out["last_count"] / out["collectives"].where(out["collectives"] > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["wait_share"] = out["wait_us"] / out["measured_us"].where(out["measured_us"] > 0)
    out = out.reset_index()[
        ["rank", "collectives", "last_count", "last_share", "late_us", "wait_us", "measured_us", "wait_share"]
    ]
    return out.sort_values(["late_us", "last_count"], ascending=False, kind="stable").reset_index(drop=True)


def arrival_matrix(df, bins: int = 200, matched=None):
    """Mean arrival delay (issue time minus the earliest rank's, us) per rank and collective bin.

    Rows: ranks; columns: the first collective index (in ``match_collectives`` order) of each
    of at most ``bins`` consecutive bins. The input of the per-rank skew heatmap; ``attrs["steps"]``:
    per column, the first step of its collectives (``bin_steps``: the heatmap's ticks).
    """
    waits = (matched or _match(df))[1]
    ncoll = int(waits["collective"].max()) + 1 if len(waits) else 0
    bins = max(1, min(bins, ncoll))
    b = waits["collective"].to_numpy() * bins // max(ncoll, 1)
    starts = (np.arange(bins) * ncoll + bins - 1) // bins  # first collective of each bin
    binned = waits.assign(bin=starts[b])
    out = binned.pivot_table(index="rank", columns="bin", values="arrival_us", aggfunc="mean")
    out.columns.name = "collective"
    return bin_steps(out, binned.groupby("bin")["step"].min())


def bin_steps(matrix, steps):
    """``matrix`` (an arrival matrix) with ``attrs["steps"]``: per column, the first step of its
    collectives (``steps``: a Series by bin), as plain ints."""
    matrix.attrs["steps"] = [int(steps.get(c, -1)) for c in matrix.columns]
    return matrix


P2P_KEYS = ["group", "channel", "src", "dst", "k"]


# what match_p2p and p2p_steps read of each side
P2P_COLUMNS = ("op", "bytes", "start_ns", "step", "rank", "wait_us")


def _p2p_sides(df, cols=P2P_COLUMNS):
    """The sends and the receives of ``df`` (calls with a peer), each indexed by ``P2P_KEYS`` (k:
    the k-th call of its group, channel, source and destination, in each rank's call order), with
    ``cols`` prefixed ``send_`` / ``recv_`` (``wait_us`` NaN where the log has no such column)."""
    if "wait_us" in cols and "wait_us" not in df.columns:
        df = df.assign(wait_us=np.nan)
    cols = list(cols)
    sel = df["op"].isin(list(P2P_SIDES)) & (df["peer"] >= 0)
    p = df.loc[sel, list(dict.fromkeys(["group", "rank", "peer", "op", "seq", *cols]))]
    p = p.assign(group=p["group"].astype(str), op=p["op"].astype(str))
    p["side"] = p["op"].map(lambda o: P2P_SIDES[o][0])
    p["channel"] = p["op"].map(lambda o: P2P_SIDES[o][1])
    is_send = p["side"] == "send"
    p["src"] = np.where(is_send, p["rank"], p["peer"])
    p["dst"] = np.where(is_send, p["peer"], p["rank"])
    p = p.sort_values(["rank", "seq"], kind="stable")
    p["k"] = p.groupby(P2P_KEYS[:-1] + ["side"]).cumcount()
    sends = p[is_send.loc[p.index]].set_index(P2P_KEYS)[cols].add_prefix("send_")
    recvs = p[~is_send.loc[p.index]].set_index(P2P_KEYS)[cols].add_prefix("recv_")
    return sends, recvs


def p2p_steps(df, sides=None):
    """Per (step, rank) with a point-to-point call: ``first_ns``, the issue of the rank's first such
    call of the step; ``wait_us``, the time its thread waited in those calls (the ``wait_us`` column:
    gloo's send / recv timed at their ``Work.wait``; NaN where none was measured); and
    ``recv_wait_us``, how long its receives waited for their sends by the issue times (per matched
    pair, the send's issue minus the receive's, when later; for logs without the waits): the
    pipeline's straggler evidence (``stragglers.verdict``). None without matched pairs. ``sides``:
    ``_p2p_sides(df, P2P_COLUMNS)`` when already computed."""
    import pandas as pd

    sends, recvs = sides if sides is not None else _p2p_sides(df, P2P_COLUMNS)
    pairs = recvs.join(sends, how="inner")
    if not len(pairs):
        return None
    wait = np.maximum(pairs["send_start_ns"].to_numpy(np.int64) - pairs["recv_start_ns"].to_numpy(np.int64), 0)
    waits = (
        pd.DataFrame(
            {"step": pairs["recv_step"].to_numpy(np.int64), "rank": pairs["recv_rank"].to_numpy(np.int64), "w": wait}
        )
        .groupby(["step", "rank"])["w"]
        .sum()
    )
    calls = pd.concat(
        [
            pd.DataFrame(
                {
                    "step": x[f"{side}_step"].to_numpy(np.int64),
                    "rank": x[f"{side}_rank"].to_numpy(np.int64),
                    "t": x[f"{side}_start_ns"].to_numpy(np.int64),
                    "wait": x[f"{side}_wait_us"].to_numpy(np.float64),
                }
            )
            for x, side in ((sends, "send"), (recvs, "recv"))
        ]
    )
    by = calls.groupby(["step", "rank"])
    out = by["t"].min().rename("first_ns").to_frame()
    out["wait_us"] = by["wait"].sum(min_count=1)
    out["recv_wait_us"] = waits.reindex(out.index).fillna(0).to_numpy(np.float64) / 1e3
    return out.reset_index()


def match_p2p(df, sides=None):
    """Pairs of point-to-point calls: k-th send a->b with the k-th receive of b from a.

    Columns: group, channel (tensor / object), src, dst, k, send_op, recv_op, send_bytes,
    recv_bytes, send_start_ns, recv_start_ns, skew_us (|difference of issue times|), late_rank
    (the side that issued last), matched (both sides present), bytes_mismatch. ``sides``:
    ``_p2p_sides(df, P2P_COLUMNS)`` when already computed.
    """
    import pandas as pd

    keys = ["group", "channel", "src", "dst"]
    sends, recvs = sides if sides is not None else _p2p_sides(df, ["op", "bytes", "start_ns"])
    sends = sends[["send_op", "send_bytes", "send_start_ns"]]
    recvs = recvs[["recv_op", "recv_bytes", "recv_start_ns"]]
    out = sends.join(recvs, how="outer").reset_index()
    out["matched"] = out["send_op"].notna() & out["recv_op"].notna()
    # in int64: an unmatched side makes the joined columns float, whose 256 ns steps at today's Unix times
    # would round the difference
    both = out["matched"].to_numpy()
    skew = np.full(len(out), np.nan)
    skew[both] = (
        np.abs(
            sends["send_start_ns"].reindex(pd.MultiIndex.from_frame(out.loc[both, keys + ["k"]])).to_numpy()
            - recvs["recv_start_ns"].reindex(pd.MultiIndex.from_frame(out.loc[both, keys + ["k"]])).to_numpy()
        )
        / 1e3
    )
    out["skew_us"] = skew
    out["late_rank"] = np.where(out["send_start_ns"] >= out["recv_start_ns"], out["src"], out["dst"])
    out["late_rank"] = out["late_rank"].where(out["matched"], -1).astype(np.int64)
    out["bytes_mismatch"] = out["matched"] & (out["send_bytes"] != out["recv_bytes"])
    return (
        out.sort_values(keys + ["k"], kind="stable").reset_index(drop=True)
        if len(out)
        else pd.DataFrame(
            columns=keys
            + [
                "k",
                "send_op",
                "recv_op",
                "send_bytes",
                "recv_bytes",
                "send_start_ns",
                "recv_start_ns",
                "matched",
                "skew_us",
                "late_rank",
                "bytes_mismatch",
            ]
        )
    )


def mismatches(df, matched=None, p2p=None):
    """The errors that hang or corrupt jobs, first occurrence first.

    One row per (group, kind) with the first collective where it happens and how many are
    affected: kind is ``op``, ``dtype``, ``bytes`` (same collective, different value on some
    ranks), ``missing`` (a member rank never recorded it), ``p2p_unmatched`` (a send without
    its receive or the reverse) or ``p2p_bytes``. Columns: kind, group, coll_seq, step, op,
    detail (which ranks had which value), affected. Empty when everything matches.
    """
    collectives, _, sub, cseq = matched or _match(df)
    if p2p is None:
        p2p = match_p2p(df)
    present = set(_present_ranks(df).tolist())
    firsts = []
    for kind, flag in MISMATCH_FLAGS:
        bad = collectives[collectives[flag]]
        for group, part in bad.groupby("group", observed=True, sort=True):
            first = part.iloc[0]
            firsts.append((kind, str(group), int(first["coll_seq"]), int(first["step"]), str(first["op"]), len(part)))
    unmatched = p2p[~p2p["matched"].astype(bool)] if len(p2p) else p2p
    if len(unmatched):
        unmatched = unmatched[unmatched["src"].isin(present) & unmatched["dst"].isin(present)]
        # the missing side's log goes on to the other side's issue: else it ended first (a log cut
        # short, a rank that stopped), no mismatch (compared as float64: the joined times are)
        no_recv = unmatched["recv_op"].isna().to_numpy()
        missing_rank = np.where(no_recv, unmatched["dst"], unmatched["src"])
        issued = np.where(no_recv, unmatched["send_start_ns"], unmatched["recv_start_ns"]).astype(np.float64)
        last_ns = df.groupby("rank")["start_ns"].max()
        unmatched = unmatched[last_ns.reindex(missing_rank).to_numpy(np.float64) >= issued]
    p2p_firsts = []
    p2p_bad = p2p[p2p["bytes_mismatch"].astype(bool)]
    for kind, bad in ((MismatchKind.P2P_UNMATCHED, unmatched), (MismatchKind.P2P_BYTES, p2p_bad)):
        for group, part in bad.groupby("group", sort=True):
            p2p_firsts.append((kind, str(group), part.iloc[0], len(part)))
    return mismatch_table(
        firsts, lambda group, coll_seq: sub[(cseq == coll_seq) & (sub["group"] == group)], p2p_firsts, present
    )


# the kinds found per collective, each with its flag column of match_collectives
MISMATCH_FLAGS = (
    (MismatchKind.OP, "op_mismatch"),
    (MismatchKind.DTYPE, "dtype_mismatch"),
    (MismatchKind.BYTES, "bytes_mismatch"),
    (MismatchKind.MISSING, "missing"),
)


def mismatch_table(firsts, rows_of, p2p_firsts, present):
    """The ``mismatches`` table from the first occurrence of each kind per group, however found.

    ``firsts``: (kind, group, coll_seq, step, op, affected) of collectives; ``rows_of(group,
    coll_seq)``: that collective's rows (rank, op, dtype, bytes, group_ranks); ``p2p_firsts``:
    (kind, group, first pair (a ``match_p2p`` row), affected); ``present``: the ranks with a log.
    """
    import pandas as pd

    rows = [
        dict(
            kind=MismatchKind(kind).value,
            group=group,
            coll_seq=coll_seq,
            step=step,
            op=op,
            detail=_detail(rows_of(group, coll_seq), kind, present),
            affected=affected,
        )
        for kind, group, coll_seq, step, op, affected in firsts
    ]
    for kind, group, first, affected in p2p_firsts:
        if kind == MismatchKind.P2P_UNMATCHED:
            missing_side = "receive" if pd.isna(first["recv_op"]) else "send"
            op = first["send_op"] if missing_side == "receive" else first["recv_op"]
            detail = (
                f"{op} #{int(first['k']) + 1} {int(first['src'])}->{int(first['dst'])} has no matching {missing_side}"
            )
        else:
            op = first["send_op"]
            detail = (
                f"{op} #{int(first['k']) + 1} {int(first['src'])}->{int(first['dst'])}: "
                f"sent {int(first['send_bytes'])} bytes, receive expects {int(first['recv_bytes'])}"
            )
        rows.append(
            dict(
                kind=MismatchKind(kind).value,
                group=group,
                coll_seq=-1,
                step=-1,
                op=str(op),
                detail=detail,
                affected=affected,
            )
        )
    out = pd.DataFrame(rows, columns=["kind", "group", "coll_seq", "step", "op", "detail", "affected"])
    return out.sort_values(["group", "coll_seq"], kind="stable").reset_index(drop=True)


def _detail(rows, kind, present) -> str:
    """Which ranks had which value for one collective's rows (only for first occurrences)."""
    if kind == MismatchKind.MISSING:
        group_ranks = str(rows["group_ranks"].iloc[0])
        expected = set(expand_ranks(group_ranks)) & present
        lacking = sorted(expected - set(rows["rank"].tolist()))
        return f"no record on rank(s) {_ranks(lacking)} (recorded by {_ranks(sorted(rows['rank']))})"
    values = rows.groupby(rows[MismatchKind(kind).value].astype(str), observed=True)["rank"].apply(sorted)
    values = sorted(values.items(), key=lambda kv: -len(kv[1]))
    return "; ".join(f"{v} on rank(s) {_ranks(r)}" for v, r in values)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ",".join(map(str, ranks[:16])) + (f",... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


@dataclass
class CrossRank:
    """Everything the cross-rank report shows, as DataFrames."""

    collectives: Any  # match_collectives
    arrivals: Any  # arrival_matrix
    ranks: Any  # rank_table
    mismatches: Any  # mismatches
    p2p: Any  # match_p2p
    missing_logs: list  # members of some group with no log file here
    step_arrivals: Any = None  # stragglers.step_arrivals: the straggler verdict's evidence
    position_arrivals: Any = None  # stragglers.position_arrivals: the same at each collective's place in the step
    p2p_steps: Any = None  # p2p_steps: a pipeline's straggler evidence (steps of point-to-point calls only)
    transfer_us: Any = None  # transfer_times: per row of the log, aligned with it
    log_ends: Any = None  # log_end_table: logs that end before the others' (not mismatches)
    clock: Any = None  # {rank: data.clock summary}: offsets to rank 0's clock (binary logs)


def cross_rank(df) -> CrossRank:
    """Match collectives across ranks and derive stragglers, waits and mismatches in one pass."""
    matched = _match(df)
    sides = _p2p_sides(df, P2P_COLUMNS)  # once, for the pairs and for a pipeline's steps
    p2p = match_p2p(df, sides)
    present = set(_present_ranks(df).tolist())
    members = set()
    for s in df["group_ranks"].cat.categories:
        members.update(expand_ranks(s))
    return CrossRank(
        collectives=matched[0],
        arrivals=arrival_matrix(df, matched=matched),
        ranks=rank_table(df, matched),
        mismatches=mismatches(df, matched, p2p),
        p2p=p2p,
        missing_logs=sorted(members - present),
        step_arrivals=step_arrivals(matched[1]),
        position_arrivals=position_arrivals(matched[0], matched[1]),
        p2p_steps=p2p_steps(df, sides) if p2p["matched"].any() else None,
        transfer_us=transfer_times(df, matched),
        log_ends=log_end_table(matched[0]),
        clock=df.attrs.get(CLOCK_ATTR),
    )


def transfer_times(df, matched=None) -> np.ndarray:
    """Per row of ``df`` (us): the call's arrival-free transfer time, from the issue of the last rank
    of its collective (or from the end of its queueing behind earlier calls of its group, when
    later) to its completion: its own time (``own_us``) without the wait for ranks that issued it
    later. Computed where every member of the group has a log in ``df`` and the duration is on the
    host's clock (host, future, wait); elsewhere (point-to-point calls, a group with a rank's log
    missing, device timings, clocks of different hosts that put the completion before the last
    issue) the call's own time."""
    waits = (matched or _match(df))[1]
    out = np.array(own_durations(df), np.float64)  # a copy: never a view of the log's column
    out[~df["op"].isin(P2P_OPS).to_numpy()] = waits["transfer_us"].to_numpy()  # _match's rows, in order
    return out


def with_transfer(df, cross=None):
    """``df`` with a ``transfer_us`` column (``transfer_times``; from ``cross``, a ``cross_rank(df)``,
    when given): the time the report's bandwidth is computed from."""
    if "transfer_us" in df.columns:
        return df
    transfer = cross.transfer_us if cross is not None and cross.transfer_us is not None else transfer_times(df)
    return df.assign(transfer_us=transfer)


def top_skew(collectives, n: int = 10):
    """The ``n`` collectives with the largest arrival skew."""
    return collectives.nlargest(n, "skew_us")[
        ["group", "coll_seq", "step", "op", "bytes", "ranks", "skew_us", "straggler", "max_duration_us"]
    ].reset_index(drop=True)
