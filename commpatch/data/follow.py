"""A rank log read while it grows: frames decoded as their bytes arrive (``Follower.feed``), the
registries kept, and a bounded window of the most recent rows with their late durations.

Fed by ``io.follow`` (the bytes appended to a ``.cplog`` file since the last look: ``commpatch
watch``) and, in the recording process, by the live metrics (the frames the flusher writes: never
the training thread). Nothing is re-parsed: each byte is decoded once. A frame cut short at the
end (the writer is mid-write, or died there) waits for the rest of its bytes; bytes that are no
frame are skipped and counted. Memory is bounded: the rows of the last ``keep_steps`` steps, at
most ``max_rows`` of them, and the late durations of those rows only.
"""

from __future__ import annotations

import json

from .frame import Cat, columns
from .logfile import _FRAME, LATE, MAGIC, META, OWN, ROWS, Parsed, _Bad, _meta
from .ops import OP_NAMES
from .schema import F_ERROR, ROW, T_DEVICE, T_FUTURE, T_NCCL, T_SHIFT, TIMINGS, row_dtype

MAX_FRAME = 1 << 28  # a frame longer than this is damage, not a flush (a flush is < 16 MB)
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
        self.late: dict[int, int] = {}  # seq -> duration ns, of rows in (or after) the window
        self.own: dict[int, int] = {}
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
        pos, end, added, rows = 0, len(buf), 0, []
        while end - pos >= _FRAME.size:
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
            stop = pos + _FRAME.size + length
            if stop > end:
                break  # the rest of this frame has not arrived yet
            payload = bytes(buf[pos + _FRAME.size : stop])
            pos = stop
            if kind == ROWS:
                rows.append(payload)
            elif kind == META:
                self._record(payload)
            else:
                pairs = self.np.frombuffer(payload, dtype="<i8").reshape(-1, 2)
                target = self.late if kind == LATE else self.own
                target.update(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist()))
        del buf[:pos]
        if rows:
            added = self._add_rows(b"".join(rows))
        self._trim()
        return added

    def _record(self, payload: bytes) -> None:
        try:
            m = json.loads(payload)
            if type(m) is dict and m.get("k") == "header" and self.parsed.header:
                # a new file of this rank (a re-initialised process group): its registries anew
                self.parsed = Parsed()
            _meta(self.parsed, m, 1 << 30)
        except (ValueError, KeyError, TypeError, RecursionError, _Bad):
            self.bad_records += 1

    def _add_rows(self, raw: bytes) -> int:
        np = self.np
        rows = np.frombuffer(raw, dtype=self.dtype)
        h = self.parsed.header
        n_ops, n_timings = len(h.get("ops", OP_NAMES)), len(h.get("timings", TIMINGS))
        ok = (
            (rows["seq"] >= 0)
            & (rows["op"] >= 0)
            & (rows["op"] < n_ops)
            & (rows["gid"] >= 0)
            & (rows["dtype"] >= 0)
            & (rows["start"] > 0)
            & (rows["flags"] >> T_SHIFT < n_timings)
            & (rows["tag"] >= 0)
            & (rows["where"] >= 0)
        )
        if not ok.all():
            self.bad_rows += int((~ok).sum())
            rows = rows[ok]
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
        rows not handed out by take_settled() yet stay unless the bound forces them out (counted)."""
        w = self.window
        if not len(w):
            return
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
            low = int(self.window["seq"][0])
            for pairs in (self.late, self.own):
                for key in [k for k in pairs if k < low]:
                    del pairs[key]

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
        seqs = set(rows["seq"].tolist())
        for pairs, seq_name, dur_name in ((self.late, "late_seq", "late_dur"), (self.own, "own_seq", "own_dur")):
            keys = [k for k in pairs if k in seqs]
            setattr(view, seq_name, np.array(keys, np.int64))
            setattr(view, dur_name, np.array([pairs[k] for k in keys], np.int64))
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
                & ~np.isin(rows["seq"], np.fromiter(self.late, np.int64, len(self.late)))
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


def _pick(column, index):
    if isinstance(column, Cat):
        return Cat(column.codes[index], column.categories)
    return column[index]
