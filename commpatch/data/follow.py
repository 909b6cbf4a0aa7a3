"""A rank log read while it grows: frames decoded as their bytes arrive (``Follower.feed``), the
registries kept, and a bounded window of the most recent rows with their late durations.

Fed by ``io.follow`` (the bytes appended to a ``.cplog`` file since the last look: ``commpatch
watch``) and, in the recording process, by the live metrics (the frames the flusher writes: never
the training thread). Nothing is re-parsed: each byte is decoded once. A frame cut short at the
end (the writer is mid-write, or died there) waits for the rest of its bytes; bytes that are no
frame are skipped and counted. Memory is bounded by the window, whatever the file holds: the rows
of the last ``keep_steps`` steps (at most ``max_rows``); the late and own durations of those rows,
and of at most ``max_rows`` rows still to come (the lowest seqs above the window: a LATE frame is
written before the ROWS frame of its rows); rows and pairs are decoded as their bytes arrive, so
no more than one record's bytes wait (a META frame, at most ``MAX_META`` bytes: a longer one is
skipped as it streams by).
"""

from __future__ import annotations

import bisect
import json
from types import SimpleNamespace
from typing import Any

from .frame import Cat, columns
from .logfile import _FRAME, LATE, MAGIC, META, OWN, ROWS, Parsed, _Bad, _header_sizes, _meta, _valid_rows
from .schema import F_ERROR, ROW, T_DEVICE, T_FUTURE, T_NCCL, T_SHIFT, row_dtype

MAX_FRAME = 1 << 28  # a frame longer than this is damage, not a flush (a flush is < 16 MB)
MAX_META = 1 << 24  # a registry record longer than this is skipped (counted), not held to be decoded
_KINDS = frozenset((ROWS, LATE, META, OWN))
_PAIR = 16
# timing codes whose duration arrives after the row (a LATE / OWN record)
LATE_TIMINGS = (T_FUTURE, T_DEVICE, T_NCCL)


class Follower:
    """One rank log, decoded incrementally. ``feed(data)`` takes the next bytes (the file's
    ``MAGIC`` first when ``with_magic``); ``window`` holds the recent rows (numpy, seq order)."""

    def __init__(
        self, max_rows: int = 1 << 16, keep_steps: int = 4, with_magic: bool = True, settling: bool = False
    ) -> None:
        import numpy as np

        self.np = np
        self.dtype = row_dtype(np)
        self.max_rows = max_rows
        self.keep_steps = keep_steps
        self.settling = settling  # rows wait in the window until take_settled() hands them out
        self.parsed = Parsed()
        self.pending = bytearray()  # bytes of a frame not complete yet (at most one frame)
        self.magic_left = len(MAGIC) if with_magic else 0
        self.window = np.empty(0, dtype=self.dtype)
        self.taken = np.zeros(0, bool)  # per window row: handed out by take_settled()
        self.late = Pairs(np)  # seq -> duration ns, of rows in (or about to enter) the window
        self.own = Pairs(np)
        self.part_kind = b""  # the frame being decoded as its bytes arrive (ROWS, LATE, OWN; META: skipped)
        self.part_left = 0  # its bytes still to come
        self.rows_seen = 0  # rows decoded in all
        self.bytes_read = 0
        self.skipped_bytes = 0  # bytes that were no frame
        self.bad_rows = 0
        self.bad_records = 0
        self.dropped_unsettled = 0  # rows pushed out of the window before they settled

    # ---- decoding ------------------------------------------------------------------------
    def feed(self, data: bytes) -> int:
        """Decode what ``data`` completes; returns the rows it added. Raises ValueError when a
        log's first bytes are not ``MAGIC`` (not a rank log)."""
        if not data:
            return 0
        self.bytes_read += len(data)
        if self.magic_left:
            head = bytes(data[: self.magic_left])
            want = MAGIC[len(MAGIC) - self.magic_left : len(MAGIC) - self.magic_left + len(head)]
            if head != want:
                raise ValueError(f"not a commpatch binary log (no {MAGIC[:-1].decode()} header)")
            self.magic_left -= len(head)
            data = data[len(head) :]
        buf = self.pending
        buf += data
        pos, end, rows = 0, len(buf), []
        pairs: dict[bytes, list[bytes]] = {LATE: [], OWN: []}
        while True:
            if self.part_left:  # inside a frame: take its whole records, the rest waits
                unit = ROW.size if self.part_kind == ROWS else _PAIR if self.part_kind in pairs else 1
                n = min(self.part_left, end - pos)
                n -= n % unit
                if not n:
                    break
                chunk = bytes(buf[pos : pos + n])
                if self.part_kind == ROWS:
                    rows.append(chunk)
                elif self.part_kind in pairs:
                    pairs[self.part_kind].append(chunk)
                pos += n
                self.part_left -= n
                continue
            if end - pos < _FRAME.size:
                break
            kind, length = _FRAME.unpack_from(buf, pos)
            if (
                kind not in _KINDS
                or length > MAX_FRAME
                or (kind == ROWS and length % ROW.size)
                or (kind in (LATE, OWN) and length % _PAIR)
            ):
                pos += 1  # not a frame here: look one byte further
                self.skipped_bytes += 1
                continue
            if kind == META and length <= MAX_META:
                stop = pos + _FRAME.size + length
                if stop > end:
                    break  # the rest of this record has not arrived yet
                self._record(bytes(buf[pos + _FRAME.size : stop]))
                pos = stop
                continue
            if kind == META:  # too long to be a registry record: skipped as it streams by
                self.bad_records += 1
            self.part_kind, self.part_left = kind, length
            pos += _FRAME.size
        del buf[:pos]
        added = self._add_rows(b"".join(rows)) if rows else 0
        for kind, chunks in pairs.items():
            if chunks:
                got = self.np.frombuffer(b"".join(chunks), dtype="<i8").reshape(-1, 2)
                (self.late if kind == LATE else self.own).update(got[:, 0], got[:, 1])
        self._trim()
        return added

    def _record(self, payload: bytes) -> None:
        try:
            m = json.loads(payload)
            if type(m) is dict and m.get("k") == "header" and self.parsed.header:
                # a new file of this rank (a re-initialised process group): its registries anew
                self.parsed = Parsed()
            _meta(self.parsed, m, self._limit())
        except (ValueError, KeyError, TypeError, RecursionError, _Bad):
            self.bad_records += 1

    def _limit(self) -> int:
        """The largest registry code this log can hold so far (each record takes 16 bytes or more),
        as the file's reader bounds them: a code past it is damage, never a list to allocate."""
        return self.bytes_read // 16 + 16

    def _add_rows(self, raw: bytes) -> int:
        np = self.np
        # the file reader's checks: impossible values and codes out of range left out (counted),
        # codes never registered given a '?' entry, so every row's codes index its registries
        p = self.parsed
        ops, timings = _header_sizes(p.header)
        scan: Any = SimpleNamespace(ops=ops, timings=timings, limit=self._limit())  # what _valid_rows reads
        before = p.bad_rows + p.zero_rows + p.repeated_rows
        rows = _valid_rows(np, p, raw, self.dtype, ROW.size, scan)
        self.bad_rows += p.bad_rows + p.zero_rows + p.repeated_rows - before
        if not len(rows):
            return 0
        window = np.concatenate((self.window, rows))
        taken = np.concatenate((self.taken, np.zeros(len(rows), bool)))
        seq = window["seq"]
        if len(seq) > 1 and not (seq[1:] > seq[:-1]).all():  # threads interleave: seq order
            order = np.argsort(seq, kind="stable")
            window, taken = window[order], taken[order]
        self.window, self.taken = window, taken
        self.rows_seen += len(rows)
        return len(rows)

    def _trim(self) -> None:
        """Keep the rows of the last ``keep_steps`` steps (at most ``max_rows``); when ``settling``,
        rows not handed out by take_settled() yet stay unless the bound forces them out (counted).
        Then the pairs of those rows, and of at most ``max_rows`` rows still to come."""
        w = self.window
        if len(w):
            step = w["step"]
            keep = step >= int(step.max()) - self.keep_steps + 1
            if self.settling:
                keep |= ~self.taken
            first = int(self.np.argmax(keep)) if keep.any() else len(w)
            first = max(first, len(w) - self.max_rows)
            if first > 0:
                if self.settling:
                    self.dropped_unsettled += int((~self.taken[:first]).sum())
                self.window, self.taken = w[first:].copy(), self.taken[first:].copy()
        seqs = self.window["seq"]
        low = int(seqs[0]) if len(seqs) else 0  # rows have seq >= 0
        for pairs in (self.late, self.own):
            pairs.bound(low, seqs, self.max_rows)
        self._bound_notes(low)

    def _bound_notes(self, low: int) -> None:
        """The registry's per-call records bounded too (each list is looked at once it holds more
        than twice ``max_rows``): notes on one call (DDP syncs, packs) and spans (buckets) of the
        window's rows and of the next ones; marks that hold from their seq on (clock offsets, step
        sources) from the one in force at the window's start; what only the file's reader uses
        (calls noted in flight, their completions, rows lost, rank 0 offsets): the latest."""
        p, most = self.parsed, self.max_rows
        for name in ("syncs", "packs"):
            notes = getattr(p, name)
            if len(notes) > 2 * most:
                setattr(p, name, sorted(n for n in notes if n[0] >= low)[:most])
        if len(p.buckets) > 2 * most:
            p.buckets = sorted(b for b in p.buckets if b[1] > low)[:most]
        for name in ("clock", "step_sources"):
            marks = getattr(p, name)
            if len(marks) > 2 * most:
                marks = sorted(marks)
                first = max(0, bisect.bisect_right([m[0] for m in marks], low) - 1)
                setattr(p, name, marks[first : first + most])
        for name in ("lost", "rank0_offsets"):
            if len(getattr(p, name)) > 2 * most:
                del getattr(p, name)[:-most]
        for name in ("inflight", "landed"):
            if len(getattr(p, name)) > 2 * most:
                setattr(p, name, dict(list(getattr(p, name).items())[-most:]))

    # ---- what was read -------------------------------------------------------------------
    def frame(self, rows=None, names=None):
        """The SCHEMA's columns (a dict of numpy arrays and ``frame.Cat``) of ``rows`` (default: the
        window), with their late durations and this log's registries."""
        return columns(self._view(self.window if rows is None else rows), names)

    def dataframe(self, rows=None, names=None):
        """The window (or ``rows``) as a pandas DataFrame of the SCHEMA's columns."""
        import pandas as pd

        cols = self.frame(rows, names)
        return pd.DataFrame(
            {
                name: pd.Categorical.from_codes(c.codes, categories=c.categories) if isinstance(c, Cat) else c
                for name, c in cols.items()
            },
            copy=False,
        )

    def _view(self, rows) -> Parsed:
        np = self.np
        view = Parsed()
        p = self.parsed
        for name in (
            "header",
            "groups",
            "dtypes",
            "tags",
            "modules",
            "clock",
            "buckets",
            "step_sources",
            "syncs",
            "packs",
            "waits",
            "device",
        ):
            setattr(view, name, getattr(p, name))
        view.rows = rows
        for pairs, seq_name, dur_name in ((self.late, "late_seq", "late_dur"), (self.own, "own_seq", "own_dur")):
            mine = np.isin(pairs.seq, rows["seq"])
            setattr(view, seq_name, pairs.seq[mine])
            setattr(view, dur_name, pairs.ns[mine])
        return view

    def take_settled(self, now_ns: int, horizon_ns: int, final: bool = False, names=None):
        """The columns of the rows that settled since the last call, in seq order: a row settles
        when its duration is known, or its timing never gives one, or it is older than
        ``horizon_ns`` (its duration stays unknown), or ``final``. A row waits while an earlier
        one does (own times follow the order of calls); the rows before them in the window are
        the context of their own times. None when no row settled. ``names``: only these columns."""
        np = self.np
        w = self.window
        if not len(w):
            return None
        new = np.flatnonzero(~self.taken)
        if not len(new):
            return None
        if not final:
            rows = w[new]
            waits = (
                np.isin(rows["flags"].astype(np.int64) >> T_SHIFT, LATE_TIMINGS)
                & ~np.isin(rows["seq"], self.late.seq)
                & ~(rows["flags"].astype(np.int64) & F_ERROR).astype(bool)
            )
            if waits.any():
                offset = self.parsed.clock[-1][1] if self.parsed.clock else 0
                young = rows["start"].astype(np.int64) + offset > now_ns - horizon_ns
                stop = np.flatnonzero(waits & young)
                if len(stop):
                    new = new[: stop[0]]
            if not len(new):
                return None
        upto = int(new[-1]) + 1
        cols = self.frame(w[:upto], names)
        self.taken[new] = True
        out = {name: _pick(c, new) for name, c in cols.items()}
        self._trim()
        return out


class Pairs:
    """(seq, ns) pairs of LATE or OWN records, numpy arrays in seq order (a seq given twice: the
    later value, as the file's reader takes it)."""

    def __init__(self, np) -> None:
        self.np = np
        self.seq = np.zeros(0, np.int64)
        self.ns = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.seq)

    def update(self, seq, ns) -> None:
        np = self.np
        seq, ns = np.concatenate((self.seq, seq)), np.concatenate((self.ns, ns))
        # the last of each seq: unique over the reversed arrays gives each seq's last occurrence
        _, last = np.unique(seq[::-1], return_index=True)
        keep = len(seq) - 1 - last
        self.seq, self.ns = seq[keep], ns[keep]

    def bound(self, low: int, window_seqs, most: int) -> None:
        """Drop the pairs below ``low`` (their rows have left the window) and, of those whose row is
        not in the window (rows still to come, or never), all but the ``most`` lowest seqs."""
        np = self.np
        first = int(np.searchsorted(self.seq, low))
        seq, ns = self.seq[first:], self.ns[first:]
        waiting = ~np.isin(seq, window_seqs)
        if int(waiting.sum()) > most:
            waiting[np.flatnonzero(waiting)[:most]] = False  # the lowest: the next rows to come
            seq, ns = seq[~waiting], ns[~waiting]
        self.seq, self.ns = seq, ns


def _pick(column, index):
    if isinstance(column, Cat):
        return Cat(column.codes[index], column.categories)
    return column[index]
