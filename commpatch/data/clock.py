"""A rank's wall clock aligned to rank 0's, from the intervals its log holds (``rank0_offset``
records: ``record.clocksync`` measured, at local time ``at``, that rank 0's clock minus this
rank's lies in [lo, hi]; and whether rank 0 runs on the same machine, by its boot id).

A rank on rank 0's machine reads the same wall clock (Linux has one CLOCK_REALTIME per machine,
time namespaces offset only the monotonic and boot clocks): its offset is 0 by construction
(``SAME_MACHINE``), never shifted by a measurement. An interval that excludes 0 there, or a round
that says another machine, is counted (``inconsistent``): a per-process clock shim, or an exchange
rewritten by a process with access to the job's store (torch's store is not authenticated).

Each interval is tightened by the others (two wall clocks drift apart by at most ``DRIFT`` per
second: Linux slews NTP corrections at 500 ppm at most; a stepped clock makes them disjoint, and
then the interval is kept as measured). A row's offset is the midpoint interpolated in time
between the measurements (constant before the first and after the last). Two consecutive rounds
whose intervals, widened by the drift allowed between them, do not meet are a ``jump``: a stepped
clock, or a tampered exchange. The offsets are applied as measured, the jump is reported, and the
rank's stated uncertainty covers it: the largest half-width of its intervals plus the range of
the offsets applied (so no arrival within it is taken for a straggler). Rank 0 is the reference
(offset 0 by definition); any other rank without a measurement is ``unmeasured``: its offset is
unknown, never taken as 0 by the analysis (``CLOCK_ATTR`` says so per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

DRIFT = 5e-4
# df.attrs key: {rank: RankClock.summary()} for the ranks of the logs read (binary logs only)
CLOCK_ATTR = "clock"
REFERENCE, SAME_MACHINE, MEASURED, UNMEASURED = "reference", "same_machine", "measured", "unmeasured"


@dataclass(frozen=True)
class RankClock:
    status: str  # REFERENCE, SAME_MACHINE, MEASURED or UNMEASURED
    at: tuple = ()  # local Unix ns of each measurement
    mid: tuple = ()  # rank 0's clock minus this rank's, ns (tightened midpoints)
    half: tuple = ()  # their half-widths, ns
    jumps: tuple = ()  # (at ns, change ns) of each round whose offset left the previous one's interval
    inconsistent: int = 0  # SAME_MACHINE: rounds excluding 0 or saying another machine (not applied)

    def shift(self, np, start_ns):
        """ns to add to this rank's ``start_ns`` (int64 array) to put it on rank 0's clock."""
        if not self.mid:
            return np.zeros(len(start_ns), np.int64)
        at = np.asarray(self.at, np.int64)
        x = (np.asarray(start_ns, np.int64) - at[0]).astype(np.float64)
        return np.rint(np.interp(x, (at - at[0]).astype(np.float64), np.asarray(self.mid, np.float64))).astype(np.int64)

    def summary(self) -> dict:
        """status; offset_us (the median offset applied, NaN when unmeasured); uncertainty_us (0 for
        the reference and rank 0's machine, NaN when unmeasured; with a jump, it covers the range of
        the offsets applied); min_offset_us, max_offset_us (the offsets applied over the run);
        jumps (rounds whose offset left the previous interval); inconsistent (rounds on rank 0's
        machine that excluded 0: not applied); measurements."""
        nan = float("nan")
        base = dict(jumps=len(self.jumps), inconsistent=self.inconsistent, measurements=len(self.at))
        if self.status in (REFERENCE, SAME_MACHINE):
            return dict(
                status=self.status, offset_us=0.0, uncertainty_us=0.0, min_offset_us=0.0, max_offset_us=0.0, **base
            )
        if not self.mid:
            return dict(
                status=UNMEASURED, offset_us=nan, uncertainty_us=nan, min_offset_us=nan, max_offset_us=nan, **base
            )
        mids = sorted(self.mid)
        spread = (mids[-1] - mids[0]) if self.jumps else 0.0
        return dict(
            status=MEASURED,
            offset_us=mids[len(mids) // 2] / 1e3,
            uncertainty_us=(max(self.half) + spread) / 1e3,
            min_offset_us=mids[0] / 1e3,
            max_offset_us=mids[-1] / 1e3,
            **base,
        )


def rank_clock(rank: int, world_size: int, intervals) -> RankClock:
    """The clock of ``rank`` from its log's (at, lo, hi, same machine) intervals."""
    if rank <= 0 or world_size <= 1:
        return RankClock(REFERENCE)
    if not intervals:
        return RankClock(UNMEASURED)
    items = sorted(i[:3] for i in intervals)
    if any(len(i) > 3 and i[3] for i in intervals):  # rank 0's machine: one wall clock, 0 by construction
        bad = sum(1 for i in intervals if not (len(i) > 3 and i[3] and i[1] <= 0 <= i[2]))
        return RankClock(SAME_MACHINE, tuple(t for t, _, _ in items), inconsistent=bad)
    at, mid, half, jumps = [], [], [], []
    for k, (t, lo, hi) in enumerate(items):
        tight_lo = max(lo2 - DRIFT * abs(t - t2) for t2, lo2, _ in items)
        tight_hi = min(hi2 + DRIFT * abs(t - t2) for t2, _, hi2 in items)
        if tight_lo > tight_hi:  # inconsistent (a clock stepped): as measured
            tight_lo, tight_hi = lo, hi
        tight_lo, tight_hi = max(tight_lo, lo), min(tight_hi, hi)
        at.append(t)
        mid.append((tight_lo + tight_hi) / 2)
        half.append((tight_hi - tight_lo) / 2)
        if k:
            t0, lo0, hi0 = items[k - 1]
            allowed = DRIFT * (t - t0)
            if lo > hi0 + allowed or hi < lo0 - allowed:  # the intervals, widened by the drift, do not meet
                jumps.append((t, int(round((lo + hi) / 2 - (lo0 + hi0) / 2))))
    return RankClock(MEASURED, tuple(at), tuple(mid), tuple(half), tuple(jumps))


__all__ = ["CLOCK_ATTR", "DRIFT", "MEASURED", "REFERENCE", "RankClock", "SAME_MACHINE", "UNMEASURED", "rank_clock"]
