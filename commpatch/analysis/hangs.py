"""Hangs: which ranks wait in which call at the end of the logs, and who never joined it.

A row is written when a call completes, so the call a rank hangs in is no row: the logs' records
of calls in flight (``record.inflight``, read as ``data.logfile.in_flight``; the watchdog's dumps
when present) say what each rank was waiting in when the job was killed. ``hangs(df, flights)``
puts them beside each rank's completed calls:

- a collective: ranks wait in the k-th collective of a group (``coll_seq``, as the report's
  matching numbers collectives: the group's calls on that rank, point-to-point ones left out);
  each other member of the group either never issued it (its last call in the group, its last
  call at all and what it is in flight in, if anything, are said), or completed it;
- point-to-point: a rank waits in its k-th send to (receive from) a peer that received (sent)
  fewer than k+1 on that group; and, from the rows alone, a send (isend) whose receive never came
  in logs that go on after it (gloo's ``isend(...).wait()`` is waited for outside any wrapper:
  nothing is in flight, its row is all there is).

A wait is a hang when it lasted at least ``MIN_WAIT_S`` and ``LONGEST_FACTOR`` times the longest
completed call of its group (shorter: "in flight", not a verdict). ``end_ns``: the end of the logs,
the latest time any rank was seen alive (its 'alive' records, its last row's end).

Pure: DataFrame and plain records in, a DataFrame out; nothing printed.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.logfile import IN_FLIGHT_ATTR
from ..data.schema import STEPLESS_ATTR, compact_ranks, expand_ranks
from .arrays import in_order, lexsort
from .matching import P2P_OPS, P2P_SIDES, collective_seq
from .summaries import durations

MIN_WAIT_S = 1.0  # a wait shorter than this is not called a hang
LONGEST_FACTOR = 10  # ... nor one shorter than this many times the group's longest completed call

COLUMNS = (
    "kind",
    "verdict",
    "group",
    "number",
    "op",
    "peer",
    "waiting",
    "missing",
    "waited_s",
    "issued_ns",
    "issued_exact",
    "end_ns",
    "detail",
)


def hangs(df, flights=None):
    """One row per call ranks wait in at the end of the logs, hangs first, then by group and number.

    ``df``: the rows of every rank (columns rank, seq, op, group, group_ranks, group_seq, peer,
    start_ns, duration_us); ``flights``: per rank log, ``data.logfile.in_flight`` dicts (default:
    ``df.attrs[IN_FLIGHT_ATTR]``). Columns: kind (collective, p2p), verdict (hang; unmatched: a send
    whose receive never came, seen in the rows alone; in flight: too short to call a hang), group,
    number (the collective's ``coll_seq``, or the k-th call of that direction between the two
    ranks, from 0), op (of the waiting ranks; 'a / b' when they differ), peer (p2p: the other
    rank), waiting and missing (ranks, range notation), waited_s (the longest wait, to the end of
    the logs), issued_ns (the earliest issue, or first sight in flight when the issue time is not
    known: issued_exact False, and waited_s is then a lower bound), end_ns (end of the logs),
    detail (one clause per rank not waiting in it, joined by '; '). Empty for rows read with a
    window of steps (``io.read(steps=...)``): a call's number counts every earlier row.

    What it reads of the rows is a ``Digest`` (``digest``: a few rows and counts per rank), so the
    engine at scale (``analysis.engine``) computes the same table from the digests of its ranks."""
    if STEPLESS_ATTR in df.attrs:  # read with a window of steps: the numbers need every row
        return empty()
    flights = merge_flights(df.attrs.get(IN_FLIGHT_ATTR, []) if flights is None else flights)
    sends = p2p_counts(df)
    ranks = set(df["rank"].unique().tolist()) if len(sends) and "rank" in df.columns else set()
    unmatched = _unmatched_sends(sends, ranks, lambda *key: _kth_send(df, *key))
    if not unmatched and not any(f["calls"] for f in flights.values()):
        return empty()  # the usual case: nothing in flight, cheaply
    return from_digest(digest(df, flights), flights, unmatched)


def empty():
    import pandas as pd

    return pd.DataFrame(columns=list(COLUMNS))


def from_digest(d: Digest, flights: dict, unmatched: list):
    """The table of ``hangs`` from the rows' digest ``d``, the merged ``flights`` and the unmatched sends."""
    import pandas as pd

    if not unmatched and not any(f["calls"] for f in flights.values()):
        return empty()
    view = _View(d, flights)
    rows = view.collectives() + view.p2p(unmatched)
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(out):
        out["_o"] = out["verdict"].map({"hang": 0, "unmatched": 1}).fillna(2)
        out = out.sort_values(["_o", "group", "number"], kind="stable").drop(columns="_o").reset_index(drop=True)
    return out


# ---- what the attribution reads of the rows ---------------------------------------------------
DIGEST_COLUMNS = ("rank", "seq", "op", "group", "peer", "start_ns", "dur", "cseq", "async_op")


@dataclass
class Digest:
    """What ``hangs`` reads of the rows, a few per rank whatever the log's length: ``rows`` (columns
    ``DIGEST_COLUMNS``: each rank's rows from its earliest call in flight on, and its last row
    overall, per group (collectives, point-to-point) and per point-to-point op and peer);
    ``counts`` (rank, group, op, peer, n: every row counted, peer -1 for collectives); ``longest``
    (group -> its longest completed call, us); ``ends`` (rank -> end of its last row, ns);
    ``members`` (group -> group_ranks). Digests of disjoint ranks concatenate (``concat``)."""

    rows: Any
    counts: Any
    longest: dict
    ends: dict
    members: dict


def digest(df, flights: dict, cseq=None) -> Digest:
    """The ``Digest`` of ``df`` (any ranks) for the calls in flight of ``flights`` (``merge_flights``).
    Vectorised on integer codes: the engine takes one per rank it stages. ``cseq``: the rows'
    ``collective_seq``, when computed already."""
    import pandas as pd

    if not len(df) or not {"rank", "seq", "op", "group", "group_ranks", "peer", "start_ns"} <= set(df.columns):
        rows = pd.DataFrame({c: pd.Series(dtype=object if c in ("op", "group") else np.int64) for c in DIGEST_COLUMNS})
        counts = pd.DataFrame(columns=["rank", "group", "op", "peer", "n"])
        return Digest(rows, counts, {}, {}, {})
    df = df.copy(deep=False)
    df.attrs = {}  # (pandas copies the attrs, the calls in flight among them, at every column read)
    rank = df["rank"].to_numpy(np.int64)
    seq = df["seq"].to_numpy(np.int64)
    op_code, op_names = _factorize(df["op"])
    group_code, group_names = _factorize(df["group"])
    p2p_code = np.isin(op_names, P2P_OPS)
    is_p2p = p2p_code[op_code]
    peer = np.where(is_p2p, df["peer"].to_numpy(np.int64), -1)
    start = df["start_ns"].to_numpy(np.int64)
    dur = durations(df) if "duration_us" in df.columns else np.full(len(df), np.nan)
    end = start + np.nan_to_num(dur) * 1e3
    cut = {
        r: min(c["seq"] if c["seq"] >= 0 else c["below"] for c in f["calls"]) for r, f in flights.items() if f["calls"]
    }
    keep = np.zeros(len(df), bool)
    ranks, at = np.unique(rank, return_inverse=True)
    at = at.ravel()
    if cut:
        # per distinct rank, not per row (a per-row lookup cost 4 us a row: half of staging a rank)
        keep = seq >= np.array([cut.get(r, np.iinfo(np.int64).max) for r in ranks.tolist()], np.int64)[at]
    # the last row (by seq) per rank; per rank, group and kind; per rank, group, p2p op and peer
    ordered = in_order((seq, rank))
    for keys, sel in (
        ((rank,), None),
        ((rank, group_code, is_p2p), None),
        ((rank, group_code, op_code, peer), is_p2p),
    ):
        keep[_last_rows(keys, seq, sel, ordered)] = True
    idx = np.flatnonzero(keep)
    idx = idx[lexsort((seq[idx], rank[idx]))]
    is_async = df["async_op"].to_numpy(bool) if "async_op" in df.columns else np.zeros(len(df), bool)
    rows = pd.DataFrame(
        {
            "rank": rank[idx],
            "seq": seq[idx],
            "op": op_names[op_code[idx]],
            "group": group_names[group_code[idx]],
            "peer": peer[idx],
            "start_ns": start[idx],
            "dur": dur[idx],
            "cseq": (collective_seq(df) if cseq is None else cseq)[idx],
            "async_op": is_async[idx],
        }
    )
    counts = _counts(ranks, at, group_code, op_code, peer, group_names, op_names)
    longest = {}
    for g in np.unique(group_code):
        d = dur[group_code == g]
        if (~np.isnan(d)).any():
            longest[str(group_names[g])] = float(np.nanmax(d))
    last = np.full(len(ranks), np.iinfo(np.int64).min)
    np.maximum.at(last, at, end.astype(np.int64))
    ends = dict(zip(ranks.tolist(), last.tolist()))
    # each group's members as its first row says them (not every row's converted to text)
    groups, first = np.unique(group_code, return_index=True)
    granks = df["group_ranks"].iloc[first].to_numpy()
    members = {str(group_names[g]): str(m) for g, m in zip(groups.tolist(), granks)}
    return Digest(rows, counts, longest, ends, members)


def _counts(ranks, at, group_code, op_code, peer, group_names, op_names):
    """The rows counted per (rank, group, op, peer), sorted so (``at``: each row's index in ``ranks``):
    one ``np.unique`` of the four as one integer (a pandas group-by of them took three times as long)."""
    import pandas as pd

    sizes = [len(ranks), len(group_names), len(op_names), int(peer.max(initial=-1)) + 2]
    codes_fit = min(group_code.min(initial=0), op_code.min(initial=0)) >= 0 and peer.min(initial=-1) >= -1
    if codes_fit and math.prod(sizes) < 2**62:
        key = ((at * sizes[1] + group_code) * sizes[2] + op_code) * sizes[3] + (peer + 1)
        key, n = np.unique(key, return_counts=True)
        key, p = np.divmod(key, sizes[3])
        key, o = np.divmod(key, sizes[2])
        r, g = np.divmod(key, sizes[1])
        seen = {"rank": ranks[r], "group": g, "op": o, "peer": p - 1, "n": n}
    else:  # (keys too many for one integer, or a missing name's code -1)
        frame = pd.DataFrame({"rank": ranks[at], "group": group_code, "op": op_code, "peer": peer})
        table = frame.groupby(["rank", "group", "op", "peer"], sort=True).size().reset_index(name="n")
        seen = {c: table[c].to_numpy() for c in table.columns}
    return pd.DataFrame(
        {
            "rank": seen["rank"].astype(np.int64),
            "group": group_names[seen["group"]],
            "op": op_names[seen["op"]],
            "peer": seen["peer"].astype(np.int64),
            "n": seen["n"].astype(np.int64),
        }
    )


def _factorize(series):
    """(int codes, names as an object array) of a column, categorical or not."""
    if series.dtype.name == "category":
        return series.cat.codes.to_numpy().astype(np.int64), np.asarray(series.cat.categories.astype(str), object)
    import pandas as pd

    codes, names = pd.factorize(series.astype(str))
    return codes.astype(np.int64), np.asarray(names, object)


def _last_rows(keys, seq, sel=None, ordered: bool = False):
    """Positions of the row with the largest ``seq`` of each distinct ``keys`` (among ``sel``).
    ``ordered``: the rows are in seq order per key already (a log's rows by rank, then seq, and
    ``keys`` start with the rank): the last of each, by hashing (a sort by the keys took 2-3x as long)."""
    import pandas as pd

    idx = np.arange(len(seq)) if sel is None else np.flatnonzero(sel)
    if not len(idx):
        return idx
    if ordered:
        if len(keys) == 1:
            key = keys[0][idx]
            return idx[np.r_[key[1:] != key[:-1], True]]
        return idx[~pd.DataFrame({i: k[idx] for i, k in enumerate(keys)}).duplicated(keep="last").to_numpy()]
    order = idx[lexsort((seq[idx],) + tuple(k[idx] for k in reversed(keys)))]
    change = np.zeros(len(order), bool)
    change[-1] = True
    for k in keys:
        ks = k[order]
        change[:-1] |= ks[:-1] != ks[1:]
    return order[change]


def concat(digests) -> Digest:
    """One ``Digest`` of the digests of disjoint sets of ranks."""
    import pandas as pd

    digests = [d for d in digests if d is not None]
    if not digests:
        return digest(pd.DataFrame(), {})
    longest: dict = {}
    members: dict = {}
    ends: dict = {}
    for d in digests:
        for g, v in d.longest.items():
            longest[g] = max(longest.get(g, v), v)
        for g, m in d.members.items():
            members.setdefault(g, m)
        ends.update(d.ends)
    rows = pd.concat([d.rows for d in digests if len(d.rows)] or [digests[0].rows], ignore_index=True)
    counts = pd.concat([d.counts for d in digests if len(d.counts)] or [digests[0].counts], ignore_index=True)
    return Digest(
        rows.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True), counts, longest, ends, members
    )


def p2p_counts(df):
    """Point-to-point calls with a peer, counted per (rank, group, op, peer): the ``Digest.counts`` of them."""
    import pandas as pd

    cols = {"rank", "peer", "op", "group"}
    if not len(df) or not cols <= set(df.columns):
        return pd.DataFrame(columns=["rank", "group", "op", "peer", "n"])
    sel = df["op"].isin(list(P2P_SIDES)).to_numpy() & (df["peer"].to_numpy() >= 0)
    sub = df.loc[sel, ["rank", "group", "op", "peer"]]
    sub = sub.assign(group=sub["group"].astype(str), op=sub["op"].astype(str))
    return sub.groupby(["rank", "group", "op", "peer"], sort=True).size().rename("n").reset_index()


def _kth_send(df, rank: int, peer: int, group: str, channel: str, k: int) -> tuple:
    """(op, start_ns) of rank's k-th send (from 0, in seq order) to peer on (group, channel)."""
    ops = [o for o, (side, ch) in P2P_SIDES.items() if side == "send" and ch == channel]
    mine = df[
        (df["rank"] == rank).to_numpy()
        & (df["peer"] == peer).to_numpy()
        & (df["group"].astype(str) == group).to_numpy()
        & df["op"].isin(ops).to_numpy()
    ].sort_values("seq", kind="stable")
    first = mine.iloc[k]
    return str(first["op"]), int(first["start_ns"])


def oldest_in_flight(flights, now_ns: int | None = None) -> dict | None:
    """The call in flight the longest among ``flights`` (``data.logfile.in_flight`` dicts, any
    ranks): its fields with ``rank`` and ``age_s`` (to ``now_ns``: now by default; from its issue,
    else from when it was first seen in flight, so at least that), or None when nothing is in flight."""
    now_ns = _time.time_ns() if now_ns is None else now_ns
    best = None
    for f in flights:
        for c in f["calls"]:
            issued = _issued(c)
            if best is None or issued < best[0]:
                best = (issued, {**c, "rank": f["rank"], "age_s": (now_ns - issued) / 1e9})
    return None if best is None else best[1]


def _unmatched_sends(counts, ranks: set, kth_send) -> list:
    """Sends (send, isend, send_object_list) to a rank with a log here (``ranks``) that received fewer
    from that rank on that group: the first send never received, as {rank, peer, group, channel,
    number, op, start_ns}. ``counts``: ``p2p_counts`` (of every rank); ``kth_send(rank, peer, group,
    channel, k)``: (op, start_ns) of that send (``_kth_send``; the engine's from its p2p table)."""
    if not len(counts):
        return []
    totals: dict = {}
    for r, g, op, peer, n in counts[["rank", "group", "op", "peer", "n"]].itertuples(index=False):
        if op in P2P_SIDES and peer >= 0:
            side, ch = P2P_SIDES[op]
            key = (int(r), int(peer), str(g), side, ch)
            totals[key] = totals.get(key, 0) + int(n)
    out = []
    for (a, b, g, side, ch), n in sorted(totals.items()):
        received = totals.get((b, a, g, "recv", ch), 0)
        if side != "send" or b not in ranks or n <= received:
            continue
        op, start = kth_send(a, b, g, ch, received)
        out.append({"rank": a, "peer": b, "group": g, "channel": ch, "number": received, "op": op, "start_ns": start})
    return out


def _issued(call) -> int:
    return call["start_ns"] if call["start_ns"] > 0 else call["seen_ns"]


def merge_flights(flights) -> dict:
    """rank -> {'alive_ns', 'calls', 'dumps'}: one per rank (a file read twice, a rank's several
    files merged). A watchdog dump (an entry with ``dump``: its path) gives a rank's calls only
    when its logs say nothing of its last moments (no record in flight, no 'alive' time)."""
    out: dict = {}
    seen = set()
    for f in sorted(flights, key=lambda f: "dump" in f):
        key = (f["rank"], f["pid"], f["alive_ns"], len(f["calls"]), f.get("dump"))
        if key in seen:
            continue
        seen.add(key)
        r = out.setdefault(int(f["rank"]), {"alive_ns": 0, "calls": [], "dumps": []})
        if "dump" in f:
            r["dumps"].append(f["dump"])
            if r["calls"] or r["alive_ns"]:
                continue
        r["alive_ns"] = max(r["alive_ns"], f["alive_ns"])
        r["calls"] += f["calls"]
    return out


def _when(ns: int, end_ns: int) -> str:
    """'12:03:04.512 UTC, 31.2 s before the end'."""
    clock = _time.strftime("%H:%M:%S", _time.gmtime(ns / 1e9)) + f".{int(ns % 1_000_000_000) // 1_000_000:03d}"
    return f"{clock} UTC, {(end_ns - ns) / 1e9:.3g} s before the end"


class _View:
    """The rows and calls in flight of every rank, indexed for the questions above."""

    def __init__(self, d: Digest, flights) -> None:
        self.flights = flights
        rows = d.rows
        self.rank = rows["rank"].to_numpy(np.int64)
        self.seq = rows["seq"].to_numpy(np.int64)
        self.op = rows["op"].astype(str).to_numpy()
        self.group = rows["group"].astype(str).to_numpy()
        self.peer = rows["peer"].to_numpy(np.int64)
        self.start = rows["start_ns"].to_numpy(np.int64)
        self.cseq = rows["cseq"].to_numpy(np.int64)
        self.is_async = rows["async_op"].to_numpy(bool)
        self.is_p2p = np.isin(self.op, P2P_OPS)
        c = d.counts
        self.counts: dict = {}
        for r, g, op, peer, n in c[["rank", "group", "op", "peer", "n"]].itertuples(index=False):
            self.counts[(int(r), str(g), str(op), int(peer))] = int(n)
        self.longest, self.ends = d.longest, d.ends
        self.members = dict(d.members)
        for r, f in flights.items():  # a call whose row shows it completed is not in flight (killed
            f["calls"] = [c for c in f["calls"] if not self._completed_since(r, c)]  # before the note)
            for call in f["calls"]:
                self.members.setdefault(call["group"], call["group_ranks"])
        self.ranks = sorted(set(d.ends) | set(flights))
        ends = [f["alive_ns"] for f in flights.values()]
        ends += list(d.ends.values())
        ends += [_issued(c) for f in flights.values() for c in f["calls"]]
        self.end_ns = max(ends, default=0)

    def _completed_since(self, r: int, call) -> bool:
        """The rows say the call completed after it was noted in flight (the process was killed
        before the flusher's next pass could say so): its own synchronous row (exact seq), or, its
        seq unknown, a later row of the same rank on the same group."""
        mine = (self.rank == r) & (self.group == call["group"])
        if call["seq"] >= 0:
            return bool((mine & (self.seq == call["seq"]) & ~self.is_async).any())
        return bool((mine & (self.seq >= call["below"])).any())

    # ---- per rank ------------------------------------------------------------------------
    def rank_end(self, r: int) -> int:
        f = self.flights.get(r, {"alive_ns": 0})
        return max(f["alive_ns"], self.ends.get(r, 0))

    def last_index(self, r: int, mask=None):
        """Position of rank ``r``'s last row (by seq) among ``mask``, or None."""
        sel = self.rank == r if mask is None else (self.rank == r) & mask
        if not sel.any():
            return None
        return int(np.flatnonzero(sel)[np.argmax(self.seq[sel])])

    def call_text(self, i) -> str:
        """'all_reduce #18 of group 0 issued at 12:00:01.000 UTC, 3 s before the end'."""
        if i is None:
            return "none"
        number = f" #{self.cseq[i] + 1}" if self.cseq[i] >= 0 else ""
        if self.cseq[i] < 0 and self.peer[i] >= 0:
            number = f" {'to' if P2P_SIDES.get(self.op[i], ('',))[0] == 'send' else 'from'} rank {self.peer[i]}"
        return f"{self.op[i]}{number} of group {self.group[i]} issued at {_when(int(self.start[i]), self.end_ns)}"

    def last_call(self, r: int, mask=None) -> str:
        return self.call_text(self.last_index(r, mask))

    def _count(self, r: int, group: str, ops=None, peer: int = -1) -> int:
        """Rows of rank ``r`` on ``group``: of ``ops`` with ``peer`` (point-to-point), else its collectives."""
        return sum(
            n
            for (rr, g, op, p), n in self.counts.items()
            if rr == r and g == group and (op in ops and p == peer if ops is not None else op not in P2P_OPS)
        )

    def coll_number(self, r: int, call) -> int:
        bound = call["seq"] if call["seq"] >= 0 else call["below"]
        after = (self.rank == r) & (self.group == call["group"]) & ~self.is_p2p & (self.seq >= bound)
        return self._count(r, call["group"]) - int(after.sum())  # the digest has every row from the bound on

    def completed(self, r: int, group: str) -> int:
        return self._count(r, group)

    def p2p_count(self, r: int, group: str, side: str, channel: str, peer: int, bound=None) -> int:
        ops = [op for op, (s, ch) in P2P_SIDES.items() if s == side and ch == channel]
        total = self._count(r, group, ops, peer)
        if bound is None:
            return total
        after = (self.rank == r) & (self.group == group) & np.isin(self.op, ops) & (self.peer == peer)
        return total - int((after & (self.seq >= bound)).sum())

    def in_flight_text(self, r: int, exclude=None) -> str:
        calls = [c for c in self.flights.get(r, {"calls": []})["calls"] if c is not exclude]
        if not calls:
            return ""
        c = min(calls, key=_issued)
        if c["op"] in P2P_SIDES:
            what = f"{c['op']} {'to' if P2P_SIDES[c['op']][0] == 'send' else 'from'} rank {c['peer']}"
        else:
            what = f"{c['op']} #{self.coll_number(r, c) + 1}"
        return f"; it waits in {what} of group {c['group']} (in flight since {_when(_issued(c), self.end_ns)})"

    def longest_us(self, group: str) -> float:
        return self.longest.get(group, 0.0)

    def verdict(self, issued: int, group: str) -> tuple[str, float]:
        waited = (self.end_ns - issued) / 1e9
        enough = waited >= MIN_WAIT_S and waited * 1e6 >= LONGEST_FACTOR * self.longest_us(group)
        return ("hang" if enough else "in flight"), waited

    # ---- collectives -----------------------------------------------------------------------
    def collectives(self) -> list:
        waits: dict = {}
        for r, f in self.flights.items():
            for c in f["calls"]:
                if c["op"] in P2P_OPS:
                    continue
                waits.setdefault((c["group"], self.coll_number(r, c)), {})[r] = c
        out = []
        for (group, k), waiting in waits.items():
            members = [m for m in expand_ranks(self.members.get(group, "")) if m in self.ranks] or sorted(waiting)
            first = min(waiting.values(), key=_issued)
            issued = _issued(first)
            verdict, waited = self.verdict(issued, group)
            ops = sorted({c["op"] for c in waiting.values()})
            details, missing = [], []
            if len(ops) > 1:
                details.append(
                    "the waiting ranks are in different calls: "
                    + "; ".join(
                        f"rank(s) {compact_ranks(sorted(r for r, c in waiting.items() if c['op'] == op))} in {op}"
                        for op in ops
                    )
                )
            for m in members:
                if m in waiting:
                    continue
                done = self.completed(m, group)
                if done > k:
                    details.append(
                        f"rank {m} completed it (its last call in group {group}: "
                        f"{self.last_call(m, self.group == group)})"
                    )
                    continue
                missing.append(m)
                in_group, last = self.last_index(m, (self.group == group) & ~self.is_p2p), self.last_index(m)
                text = f"rank {m} never issued it: its last collective in group {group} was {self.call_text(in_group)}"
                if last is not None and last != in_group:
                    text += f"; its last call at all was {self.call_text(last)}"
                text += self.in_flight_text(m)
                if self.rank_end(m) < issued:
                    text += f"; its log ends at {_when(self.rank_end(m), self.end_ns)}, before the wait began (it may have died)"
                details.append(text)
            dumps = [d for r in sorted(waiting) for d in self.flights[r]["dumps"]]
            if dumps:
                details.append("the watchdog's dumps (stacks): " + ", ".join(dumps))
            if not missing and len(ops) == 1:
                details.append(
                    f"every member with a log here ({compact_ranks(members)}) issued it: they all wait in it "
                    "(a peer or transport failure, or a member without a log here)"
                )
            out.append(
                dict(
                    kind="collective",
                    verdict=verdict,
                    group=group,
                    number=k + 1,  # counted from 1, as users and Flight Recorder count
                    op=" / ".join(ops),
                    peer=-1,
                    waiting=compact_ranks(sorted(waiting)),
                    missing=compact_ranks(missing),
                    waited_s=waited,
                    issued_ns=issued,
                    issued_exact=first["start_ns"] > 0,
                    end_ns=self.end_ns,
                    detail="; ".join(details),
                )
            )
        return out

    # ---- point to point -----------------------------------------------------------------
    def p2p(self, unmatched) -> list:
        out, covered = [], set()
        for r, f in self.flights.items():
            for c in f["calls"]:
                if c["op"] not in P2P_SIDES or c["peer"] < 0:
                    continue
                side, channel = P2P_SIDES[c["op"]]
                other = "recv" if side == "send" else "send"
                bound = c["seq"] if c["seq"] >= 0 else c["below"]
                k = self.p2p_count(r, c["group"], side, channel, c["peer"], bound)
                covered.add((r, c["peer"], c["group"], side, channel, k))
                out.append(self._p2p_row(r, c["peer"], c["group"], c["op"], side, channel, other, k, _issued(c), c))
        # from the rows alone: sends whose receive never came, in logs that go on after them (a
        # receive posted early is no wait until its thread waits in it: only sends)
        for u in unmatched:
            if (u["rank"], u["peer"], u["group"], "send", u["channel"], u["number"]) in covered:
                continue
            row = self._p2p_row(
                u["rank"],
                u["peer"],
                u["group"],
                u["op"],
                "send",
                u["channel"],
                "recv",
                u["number"],
                u["start_ns"],
                None,
            )
            if row["verdict"] == "hang" and row["missing"]:  # else: too recent, or being received
                row["verdict"] = "unmatched"
                out.append(row)
        return out

    def _p2p_row(self, r, peer, group, op, side, channel, other, k, issued, call) -> dict:
        verdict, waited = self.verdict(issued, group)
        if peer not in self.ranks:
            detail = f"rank {peer} has no log here"
            missing = ""
        else:
            theirs = self.p2p_count(peer, group, other, channel, r)
            waits = [
                c
                for c in self.flights.get(peer, {"calls": []})["calls"]
                if c["op"] in P2P_SIDES and P2P_SIDES[c["op"]] == (other, channel) and c["peer"] == r
            ]
            if theirs > k:
                detail, missing = f"rank {peer} completed the matching {other} ({theirs} in all)", ""
            elif waits:
                detail, missing = f"rank {peer} waits in the matching {waits[0]['op']}", ""
            else:
                verb = "posted the matching recv" if other == "recv" else "sent it"
                mask = (
                    (self.group == group)
                    & np.isin(self.op, [o for o, (s, ch) in P2P_SIDES.items() if s == other and ch == channel])
                    & (self.peer == r)
                )
                detail = (
                    f"rank {peer} never {verb}: it has {theirs} {other}(s) {'from' if other == 'recv' else 'to'} "
                    f"rank {r} on group {group} (the last: {self.last_call(peer, mask)}); its last call was "
                    f"{self.last_call(peer)}{self.in_flight_text(peer)}"
                )
                if self.rank_end(peer) < issued:
                    detail += f"; its log ends at {_when(self.rank_end(peer), self.end_ns)}, before the wait began"
                missing = str(peer)
            if call is None and side == "send":
                detail += (
                    "; the send was waited for outside commpatch's wrappers (isend(...).wait()), so the log "
                    "cannot tell that rank " + str(r) + " still waits in it"
                )
        dumps = self.flights.get(r, {"dumps": []})["dumps"]
        if dumps:
            detail += "; the watchdog's dumps (stacks): " + ", ".join(dumps)
        return dict(
            kind="p2p",
            verdict=verdict,
            group=group,
            number=k + 1,
            op=op,
            peer=peer,
            waiting=str(r),
            missing=missing,
            waited_s=waited,
            issued_ns=issued,
            issued_exact=call is None or call["start_ns"] > 0,
            end_ns=self.end_ns,
            detail=detail,
        )
