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

import time as _time

import numpy as np

from ..data.logfile import IN_FLIGHT_ATTR
from ..data.schema import STEPLESS_ATTR, compact_ranks, expand_ranks
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
    window of steps (``io.read(steps=...)``): a call's number counts every earlier row."""
    import pandas as pd

    if STEPLESS_ATTR in df.attrs:  # read with a window of steps: the numbers need every row
        return pd.DataFrame(columns=list(COLUMNS))
    flights = merge_flights(df.attrs.get(IN_FLIGHT_ATTR, []) if flights is None else flights)
    unmatched = _unmatched_sends(df)
    if not unmatched and not any(f["calls"] for f in flights.values()):
        return pd.DataFrame(columns=list(COLUMNS))  # the usual case: nothing in flight, cheaply
    view = _View(df, flights)
    rows = view.collectives() + view.p2p(unmatched)
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(out):
        out["_o"] = out["verdict"].map({"hang": 0, "unmatched": 1}).fillna(2)
        out = out.sort_values(["_o", "group", "number"], kind="stable").drop(columns="_o").reset_index(drop=True)
    return out


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


def _unmatched_sends(df) -> list:
    """Sends (send, isend, send_object_list) to a rank with a log here that received fewer from
    that rank on that group: the first send never received, as {rank, peer, group, number, op,
    start_ns}. Vectorised over the point-to-point rows only."""
    if not len(df) or not {"rank", "peer", "op", "group", "seq", "start_ns"} <= set(df.columns):
        return []
    sel = df["op"].isin(list(P2P_SIDES)).to_numpy() & (df["peer"].to_numpy() >= 0)
    if not sel.any():
        return []
    sub = df.loc[sel, ["rank", "peer", "op", "group", "seq", "start_ns"]]
    op = sub["op"].astype(str)
    sub = sub.assign(
        op=op,
        group=sub["group"].astype(str),
        side=op.map(lambda o: P2P_SIDES[o][0]),
        channel=op.map(lambda o: P2P_SIDES[o][1]),
    )
    keys = ["rank", "peer", "group", "side", "channel"]
    counts = sub.groupby(keys).size().to_dict()
    ranks = set(df["rank"].unique().tolist())
    out = []
    for (a, b, g, side, ch), n in counts.items():
        received = counts.get((b, a, g, "recv", ch), 0)
        if side != "send" or b not in ranks or n <= received:
            continue
        mine = sub[
            (sub["rank"] == a)
            & (sub["peer"] == b)
            & (sub["group"] == g)
            & (sub["side"] == "send")
            & (sub["channel"] == ch)
        ].sort_values("seq", kind="stable")
        first = mine.iloc[received]
        out.append(
            {
                "rank": int(a),
                "peer": int(b),
                "group": g,
                "channel": ch,
                "number": int(received),
                "op": first["op"],
                "start_ns": int(first["start_ns"]),
            }
        )
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

    def __init__(self, df, flights) -> None:
        self.flights = flights
        cols = {"rank", "seq", "op", "group", "group_ranks", "group_seq", "peer", "start_ns"}
        self.df = df if cols <= set(df.columns) else None
        if self.df is not None and len(df):
            self.rank = df["rank"].to_numpy()
            self.seq = df["seq"].to_numpy()
            self.op = df["op"].astype(str).to_numpy()
            self.group = df["group"].astype(str).to_numpy()
            self.peer = df["peer"].to_numpy()
            self.start = df["start_ns"].to_numpy()
            dur = durations(df) if "duration_us" in df.columns else np.full(len(df), np.nan)
            self.dur = dur
            self.end = self.start + np.nan_to_num(dur) * 1e3
            self.cseq = collective_seq(df)
            self.is_p2p = np.isin(self.op, P2P_OPS)
            members: dict = {}
            for g, gr in zip(df["group"].astype(str), df["group_ranks"].astype(str)):
                members.setdefault(g, gr)
            self.members = members
        else:
            self.rank = self.seq = self.peer = self.start = self.end = self.cseq = self.dur = np.zeros(0, np.int64)
            self.op = self.group = np.zeros(0, object)
            self.is_p2p = np.zeros(0, bool)
            self.members = {}
        self.is_async = (
            df["async_op"].to_numpy(bool)
            if self.df is not None and "async_op" in df.columns and len(df)
            else np.zeros(len(self.rank), bool)
        )
        for r, f in flights.items():  # a call whose row shows it completed is not in flight (killed
            f["calls"] = [c for c in f["calls"] if not self._completed_since(r, c)]  # before the note)
            for c in f["calls"]:
                self.members.setdefault(c["group"], c["group_ranks"])
        self.ranks = sorted(set(self.rank.tolist()) | set(flights))
        ends = [f["alive_ns"] for f in flights.values()]
        if len(self.end):
            ends.append(int(np.nanmax(self.end)))
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
        mine = self.end[self.rank == r]
        return max(f["alive_ns"], int(mine.max()) if len(mine) else 0)

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
        number = f" #{self.cseq[i]}" if self.cseq[i] >= 0 else ""
        if self.cseq[i] < 0 and self.peer[i] >= 0:
            number = f" {'to' if P2P_SIDES.get(self.op[i], ('',))[0] == 'send' else 'from'} rank {self.peer[i]}"
        return f"{self.op[i]}{number} of group {self.group[i]} issued at {_when(int(self.start[i]), self.end_ns)}"

    def last_call(self, r: int, mask=None) -> str:
        return self.call_text(self.last_index(r, mask))

    def coll_number(self, r: int, call) -> int:
        bound = call["seq"] if call["seq"] >= 0 else call["below"]
        sel = (self.rank == r) & (self.group == call["group"]) & ~self.is_p2p & (self.seq < bound)
        return int(sel.sum())

    def completed(self, r: int, group: str) -> int:
        return int(((self.rank == r) & (self.group == group) & ~self.is_p2p).sum())

    def p2p_count(self, r: int, group: str, side: str, channel: str, peer: int, bound=None) -> int:
        ops = [op for op, (s, ch) in P2P_SIDES.items() if s == side and ch == channel]
        sel = (self.rank == r) & (self.group == group) & np.isin(self.op, ops) & (self.peer == peer)
        if bound is not None:
            sel &= self.seq < bound
        return int(sel.sum())

    def in_flight_text(self, r: int, exclude=None) -> str:
        calls = [c for c in self.flights.get(r, {"calls": []})["calls"] if c is not exclude]
        if not calls:
            return ""
        c = min(calls, key=_issued)
        if c["op"] in P2P_SIDES:
            what = f"{c['op']} {'to' if P2P_SIDES[c['op']][0] == 'send' else 'from'} rank {c['peer']}"
        else:
            what = f"{c['op']} #{self.coll_number(r, c)}"
        return f"; it waits in {what} of group {c['group']} (in flight since {_when(_issued(c), self.end_ns)})"

    def longest_us(self, group: str) -> float:
        d = self.dur[(self.group == group)] if len(self.dur) else np.zeros(0)
        d = d[~np.isnan(d)] if len(d) else d
        return float(d.max()) if len(d) else 0.0

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
                    number=k,
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
            number=k,
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
