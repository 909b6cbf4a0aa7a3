"""The cross-rank report at cluster scale, on an embedded analytic engine (DuckDB).

The pandas path (``summaries``, ``matching``) holds every rank's rows in one DataFrame: memory
grows with the rows (256 ranks x 100k rows: 6.8 GiB). Here each rank's rows are read, reduced to
a few integer columns and written as a Parquet file in a temporary directory, one rank at a time
(``stage``, in the reading processes), and DuckDB queries those files with multi-threaded SQL
within a memory limit (spilling beyond it): the summary (exact quantiles),
the match of every collective by (group, collective sequence number), stragglers, mismatches and
point-to-point pairs. Per-rank work (the collective sequence number, the per-step view of one
rank) reuses the pandas functions, so both paths give the same answers
(``tests/test_engine.py`` compares them). Results come back as pandas DataFrames with the
columns of the pandas path (``Results``).

Measured against Polars' lazy engine on the same data: docs/decisions/report-at-scale.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.clock import CLOCK_ATTR
from ..data.logfile import IN_FLIGHT_ATTR, JOB_ATTR
from ..data.ops import describe_op
from ..data.schema import STEPLESS_ATTR, expand_ranks
from . import hangs as _hangs
from .advice import RANK_STEPS_READS, fsdp_gather_mask
from .arrays import lexsort
from .findings import ENGINE_LEFT_OUT
from .hangs import merge_flights
from .matching import (
    MISMATCH_FLAGS,
    P2P_OPS,
    P2P_SIDES,
    MismatchKind,
    bin_steps,
    collective_seq,
    counts_by_group,
    log_end_rows,
    mismatch_table,
    reach_steps,
    releases,
)
from .pattern import ATTR as PATTERN_ATTR
from .pattern import warn_refused, with_pattern_steps
from .steps import SETUP_OPS, _bucket_mask, per_step, setup_from
from .summaries import HOST_CLOCK_NAMES, durations, finish_summary, own_durations, size_bucket

AUTO_BYTES = 256 << 20  # 'auto' takes the engine from this much input on (and when installed)
# The advice rules that read rows (advice.ROW_RULES) get the rows they read: DDP's buckets whole, and
# the steady-state calls with bytes (small messages), these columns, at most ADVICE_ROWS of them.
ADVICE_COLUMNS = (
    "rank",
    "seq",
    "step",
    "op",
    "collective",
    "group",
    "bytes",
    "start_ns",
    "duration_us",
    "own_us",
    "async_op",
    "sync_end_us",
    "pack_us",
    "bucket_params",
    "bucket",
    "device",
)
# and FSDP's backward all-gathers (advice.fsdp_reshard) with these besides
FSDP_GATHER_COLUMNS = ("phase", "module", "timing", "wait_us", "group_ranks")
ADVICE_ROWS = 5_000_000  # ~40 bytes each in memory: the small-message advice is left out beyond


# Floating-point sums in a fixed order: DuckDB adds the values of a group on several threads in
# whatever order they come, so the last bits of a double sum varied from one run to the next. Each
# value is summed as a 128-bit decimal of 18 digits after the point instead (integer addition:
# the same result in any order), then given back as a double; non-finite values are not summed
# (pandas skips NaN likewise). Cost measured: docs/reporting.md (At scale).
_EXACT = "DECIMAL(38, 18)"
_SUMMED = ("dur", "own", "transfer", "busbytes")  # the summary's sums


def _sum(x: str) -> str:
    return f"sum(CASE WHEN isfinite({x}) THEN ({x})::{_EXACT} END)::DOUBLE"


def _avg(x: str) -> str:
    return f"({_sum(x)} / count(CASE WHEN isfinite({x}) THEN 1 END))"


class EngineError(RuntimeError):
    """DuckDB could not compute the report (out of memory or disk space for its temporary files)."""


def _per_distinct(values, function):
    """``function`` of each value (None for a missing one), called once per distinct value (2 M rows
    decoded one by one in Python: 3.9 s; so: 0.1 s)."""
    import pandas as pd

    codes, uniques = pd.factorize(values, use_na_sentinel=True)
    return np.array([function(u) for u in uniques] + [None], dtype=object)[codes]


def available() -> bool:
    """DuckDB is installed (``pip install 'commpatch[scale]'``)."""
    return importlib.util.find_spec("duckdb") is not None


# ---- one rank's rows, reduced and staged (runs in the reading processes) ----------------------
@dataclass
class Staged:
    """What the engine keeps in memory of one rank whose rows were written to its directory:
    names behind the integer codes, counts for the notes, each group's members."""

    names: dict
    group_ranks: dict
    ranks: list
    calls: int
    unmeasured: int
    p2p_calls: int
    batch_calls: int
    pattern: dict = field(default_factory=dict)  # rank -> pattern.Found or why not (no step boundary)
    in_flight: int = 0  # calls its logs say were in flight at the end (data.logfile.in_flight): a hang?
    clock: dict = field(default_factory=dict)  # rank -> data.clock summary (binary logs)
    flights: list = field(default_factory=list)  # its data.logfile.in_flight dicts (watchdog dumps too)
    hang_digest: Any = None  # hangs.Digest of its rows (None: read with a window of steps)
    job: list = field(default_factory=list)  # its job notes (data.logfile.JOB_ATTR: step marks, settings)
    released: int = 0  # rows whose rank's last blocking rooted collective is known (matching.releases)


_CAT_COLUMNS = ("group", "op", "dtype")


def code_of(name: str) -> int:
    """The engine's code for a name (a group, op, dtype, ...): a 64-bit hash, so that the
    processes reading ranks in parallel agree on codes without talking to each other."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _codes(series, names: dict, column: str):
    """int64 engine codes of a column, its names recorded in ``names[column]``."""
    s = series if series.dtype.name == "category" else series.astype("category")
    cats = [str(c) for c in s.cat.categories]
    lut = np.array([code_of(c) for c in cats] or [0], np.int64)
    names.setdefault(column, {}).update(zip(lut.tolist(), cats))
    codes = s.cat.codes.to_numpy()
    return lut[codes] if len(codes) else np.zeros(0, np.int64), lut, s.cat.codes.to_numpy()


def stage(df, directory: str, by=("collective", "size_bucket"), steps=None, window=None) -> Staged | None:
    """Reduce the rows of one rank (the columns ``report`` reads, and those in ``by``) to integer
    columns and write them, its per-step view and its point-to-point calls as Parquet files
    under ``directory`` (``rows/``, ``steps/``, ``p2p/``), which the ``Engine`` queries. A rank
    without step boundaries gets its steps from its pattern of calls first (``window``: then
    only the steps first <= step < stop are kept, see ``pattern.with_pattern_steps``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = with_pattern_steps(df, warn=False, window=window) if len(df) else df  # the engine warns once
    if len(df) == 0:
        return None
    by = [by] if isinstance(by, str) else list(by)
    names: dict = {}
    dur = durations(df)
    nbytes = df["bytes"].to_numpy(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = df["busbw_gbps"].to_numpy(np.float64) / df["algbw_gbps"].to_numpy(np.float64)
    measured = ~np.isnan(dur)
    rank = df["rank"].to_numpy(np.int64)
    rows = {"rank": rank.astype(np.int32)}
    local = {}
    for column in _CAT_COLUMNS:
        rows[column], _, local[column] = _codes(df[column], names, column)
    rows["cseq"] = collective_seq(df)
    rows["seq"] = df["seq"].to_numpy(np.int64)  # the rank's call order (the advice's back-to-back calls)
    rows["bytes"] = nbytes
    rows["start_ns"] = df["start_ns"].to_numpy(np.int64)
    rows["dur"] = dur
    rows["own"] = own_durations(df)
    rows["host"] = df["timing"].isin(HOST_CLOCK_NAMES).to_numpy()  # for the transfer time (matching.transfer_times)
    rows["busbytes"] = np.where(measured & (factor > 0), nbytes * np.nan_to_num(factor), 0.0)
    rows["step"] = df["step"].to_numpy(np.int64)
    # when the rank was released by its last rooted collective that held the host (the straggler's
    # evidence leaves out a later release: matching.releases); null where unknown
    rel, pkey, known = releases(df, rows["cseq"], rows["group"])
    rows["rel"] = pa.array(rel, mask=~known)
    rows["pkey"] = pa.array(pkey, mask=~known)
    released = int(known.sum())
    bucketed = _bucket_mask(df)
    rows["bucketed"] = bucketed  # DDP's gradient buckets: the advice reads them apart (advice.bucket_steps)
    gathered = fsdp_gather_mask(df)
    rows["fsdp_gather"] = gathered  # FSDP's backward all-gathers: apart too (advice.fsdp_reshard)
    for i, key in enumerate(by):
        if key == "size_bucket":
            rows[f"k{i}"] = size_bucket(df["bytes"])
        elif df[key].dtype.name in ("category", "object"):
            rows[f"k{i}"] = _codes(df[key], names, f"k{i}")[0]
        else:
            rows[f"k{i}"] = df[key].to_numpy()
    first = int(rank.min())
    os.makedirs(os.path.join(directory, "rows"), exist_ok=True)
    name = f"rank{first}-{os.getpid()}-{code_of(repr(rows['start_ns'][:4].tolist())) & 0xFFFFFF:06x}.parquet"
    # dictionary pages only where values repeat (measured: 38 -> 14 ms for 100k rows)
    low = [c for c in rows if c in ("rank", "group", "op", "dtype", "bytes") or c.startswith("k")]
    pq.write_table(
        pa.table({k: v if isinstance(v, pa.Array) else pa.array(v, from_pandas=True) for k, v in rows.items()}),
        os.path.join(directory, "rows", name),
        row_group_size=1 << 20,
        use_dictionary=low,
    )
    # the rows the advice reads whole (a few per step): DDP's buckets; FSDP's backward all-gathers
    for table, mask, extra in (("buckets", bucketed, ()), ("fsdp", gathered, FSDP_GATHER_COLUMNS)):
        if not mask.any():
            continue
        cols = [c for c in ADVICE_COLUMNS + extra if c in df.columns]
        sub = df.loc[mask, cols].reset_index(drop=True)
        for column in sub.columns:
            if sub[column].dtype.name == "category":
                sub[column] = sub[column].astype(str)
        sub = sub.assign(
            g=rows["group"][mask],
            cseq=rows["cseq"][mask],
            own=rows["own"][mask],
            dur=rows["dur"][mask],
            host=rows["host"][mask],
        )
        os.makedirs(os.path.join(directory, table), exist_ok=True)
        pq.write_table(pa.Table.from_pandas(sub, preserve_index=False), os.path.join(directory, table, name))
    table = per_step(df, steps=steps)
    if len(table):
        os.makedirs(os.path.join(directory, "steps"), exist_ok=True)
        pq.write_table(
            pa.Table.from_pandas(table, preserve_index=False),
            os.path.join(directory, "steps", name),
            use_dictionary=["rank", "stage", "step_source", "step_time_from"],
        )
    ops = df["op"].cat.categories if df["op"].dtype.name == "category" else None
    p2p = _p2p_rows(df, local["op"], [str(o) for o in ops] if ops is not None else None, rows)
    if p2p is not None:
        os.makedirs(os.path.join(directory, "p2p"), exist_ok=True)
        pq.write_table(
            pa.table(p2p),
            os.path.join(directory, "p2p", name),
            use_dictionary=["group", "channel", "src", "dst", "side", "op", "bytes"],
        )
    if df["group_ranks"].dtype.name == "category":
        groups, granks = df["group"].cat.categories, df["group_ranks"].cat.categories
        pairs = np.unique(local["group"].astype(np.int64) * (len(granks) + 1) + df["group_ranks"].cat.codes.to_numpy())
        group_ranks = {str(groups[a]): str(granks[b]) for a, b in zip(*np.divmod(pairs, len(granks) + 1))}
    else:
        sub = df[["group", "group_ranks"]].drop_duplicates()
        group_ranks = dict(zip(sub["group"].astype(str), sub["group_ranks"].astype(str)))
    is_p2p = df["op"].isin(P2P_OPS).to_numpy()
    flights = list(df.attrs.get(IN_FLIGHT_ATTR, ()))
    return Staged(
        names=names,
        group_ranks=group_ranks,
        ranks=sorted(set(rank.tolist())),
        calls=len(df),
        unmeasured=int((~measured).sum()),
        p2p_calls=int(is_p2p.sum()),
        batch_calls=int((df["op"] == "batch_isend_irecv").sum()),
        pattern=df.attrs.get(PATTERN_ATTR, {}),
        clock=df.attrs.get(CLOCK_ATTR, {}),
        job=list(df.attrs.get(JOB_ATTR) or []),
        in_flight=sum(len(f["calls"]) for f in merge_flights(flights).values()),
        flights=flights,
        # what the hang attribution reads of its rows (a few; analysis.hangs), as the pandas path reads them
        hang_digest=None if STEPLESS_ATTR in df.attrs else _hangs.digest(df, merge_flights(flights), rows["cseq"]),
        released=released,
    )


def _p2p_rows(df, op_local, op_names, rows):
    """Sends and receives with a peer, keyed as ``matching.match_p2p`` pairs them: the k-th call
    of each (group, channel, src, dst, side) of this rank in seq order. Channel 0: object, 1:
    tensor (the order of their names); side 0: send, 1: receive. None when there is none."""
    if op_names is None:
        op_names = sorted(set(df["op"].astype(str)))
        op_local = np.searchsorted(op_names, df["op"].astype(str).to_numpy())
    side_of = np.array([{"send": 0, "recv": 1}.get(P2P_SIDES.get(o, ("",))[0], -1) for o in op_names] or [-1], np.int8)
    channel_of = np.array([P2P_SIDES.get(o, ("", "tensor"))[1] == "tensor" for o in op_names] or [1], np.int8)
    peer = df["peer"].to_numpy(np.int64)
    sel = np.flatnonzero((side_of[op_local] >= 0) & (peer >= 0)) if len(op_local) else np.zeros(0, np.int64)
    if not len(sel):
        return None
    seq, rank = df["seq"].to_numpy(np.int64)[sel], rows["rank"][sel].astype(np.int64)
    order = lexsort((seq, rank))
    sel = sel[order]
    side, channel = side_of[op_local[sel]], channel_of[op_local[sel]]
    rank, peer = rows["rank"][sel].astype(np.int64), peer[sel]
    src, dst = np.where(side == 0, rank, peer), np.where(side == 0, peer, rank)
    group = rows["group"][sel]
    # k: the running count within equal keys, in seq order (lexsort is stable)
    keys = (side, dst, src, channel, group)
    by_key = lexsort(keys)
    change = np.zeros(len(sel), bool)
    change[0] = True
    for x in keys:
        xs = x[by_key]
        change[1:] |= xs[1:] != xs[:-1]
    start = np.maximum.accumulate(np.where(change, np.arange(len(sel)), 0))
    k = np.empty(len(sel), np.int64)
    k[by_key] = np.arange(len(sel)) - start
    return {
        "group": group,
        "channel": channel,
        "src": src,
        "dst": dst,
        "side": side,
        "k": k,
        "op": rows["op"][sel],
        "bytes": rows["bytes"][sel],
        "start_ns": rows["start_ns"][sel],
        "step": rows["step"][sel],
        "wait": df["wait_us"].to_numpy(np.float64)[sel] if "wait_us" in df.columns else np.full(len(sel), np.nan),
    }


# ---- the engine ----------------------------------------------------------------------------
@dataclass
class Results:
    """What the report shows, as the pandas path computes it (``render.text.build_report``)."""

    summary: Any
    per_step: Any
    mismatches: Any = None
    ranks: Any = None
    skew: Any = None
    p2p: Any = None  # per channel (the report's p2p section)
    arrivals: Any = None  # only when asked (plots)
    by_op_size: Any = None  # summary by op and size_bucket (plots)
    missing_logs: list = field(default_factory=list)
    step_arrivals: Any = None  # stragglers.step_arrivals
    position_arrivals: Any = None  # stragglers.position_candidates' result (frame, tests)
    p2p_steps: Any = None  # matching.p2p_steps: a pipeline's straggler evidence
    setup: Any = None  # steps.setup_from: the set-up finding's figures
    by_rank_steps: Any = None  # steps.per_step(by_rank=True), for the straggler advice
    ops: Any = None  # the ops of the rows (sorted names), for the findings
    unmeasured_ops: Any = None  # the ops of steady-state calls without a duration (findings._unmeasured_ops)
    bus_summary: Any = None  # summary by collective and size_bucket of the steady state (findings.slowest_bus)
    in_flight: int = 0  # calls the logs say were in flight at the end (Staged.in_flight, summed)
    hangs: Any = None  # hangs.hangs's table, from the ranks' digests
    advice_rows: Any = None  # the rows the advice rules read (ADVICE_COLUMNS and transfer_us), or None
    left_out: str = ""  # what the engine's report does not look at (said in a finding), or ''
    log_ends: Any = None  # matching.log_end_table
    clock: Any = None  # {rank: data.clock summary}, as matching.CrossRank's
    job: Any = None  # the ranks' job notes (data.logfile.JOB_ATTR), in rank order, as the readers give them
    rank_list: list = field(default_factory=list)
    calls: int = 0
    unmeasured: int = 0
    p2p_calls: int = 0
    batch_calls: int = 0


# ranks staged together, up to this many bytes of their logs (io.read_ranks' batch_bytes): a rank
# alone costs ~0.1 s of pandas whatever its rows (1,024 ranks x 2,000 rows: 123 ms per rank)
STAGE_BATCH_BYTES = 16 << 20


class Engine:
    """Stage each rank's rows into ``directory`` (``stage``, e.g. in the reading processes), give
    the engine what ``stage`` returned (``add``), then ``results()``: DuckDB queries the staged
    Parquet files in parallel, within ``memory_limit`` (spilling to the same temporary
    directory beyond it). ``close()`` removes the directory."""

    def __init__(
        self,
        by=("collective", "size_bucket"),
        memory_limit: str = "2GB",
        threads: int | None = None,
        temp_dir: str | None = None,
    ) -> None:
        self.by = [by] if isinstance(by, str) else list(by)
        self.directory = tempfile.mkdtemp(prefix="commpatch-engine-", dir=temp_dir)
        self.memory_limit, self.threads = memory_limit, threads
        self.con: Any = None  # duckdb connection, made on first use
        self.names: dict = {}  # column -> {code: name}
        self.group_ranks: dict = {}
        self.seen_ranks: set = set()
        self.pattern: dict = {}  # rank -> pattern.Found or why its steps were not found
        self.clock: dict = {}  # rank -> data.clock summary (its offset to rank 0's clock)
        self.job: list = []  # the ranks' job notes (step marks, settings)
        self.counts: dict[str, Any] = dict(calls=0, unmeasured=0, p2p_calls=0, batch_calls=0)
        self.released = 0  # rows with a known release by a blocking rooted collective: _step_arrivals corrects
        self.tables: set = set()
        self.flights: list = []  # every rank's data.logfile.in_flight dicts
        self.digests: list = []  # every rank's hangs.Digest (None for a rank read with a window of steps)
        self.matched: bool | None = None  # the collectives matched (the coll table): transfer times known

    def close(self) -> None:
        try:
            if self.con is not None:
                self.con.close()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, staged: Staged | None) -> None:
        """Take in what ``stage`` returned for one rank (its rows are already in the directory)."""
        if staged is None:
            return
        overlap = self.seen_ranks.intersection(staged.ranks)
        if overlap:
            raise ValueError(f"rank(s) {sorted(overlap)} given twice to the engine: add each rank's rows once")
        self.seen_ranks.update(staged.ranks)
        for key in self.counts:
            self.counts[key] += getattr(staged, key)
        for name, ranks in staged.group_ranks.items():
            self.group_ranks.setdefault(name, ranks)
        for column, names in staged.names.items():
            self.names.setdefault(column, {}).update(names)
        self.pattern.update(staged.pattern)
        self.clock.update(staged.clock)
        self.job += staged.job
        self.flights += staged.flights
        self.digests.append(staged.hang_digest)
        self.released += staged.released

    def _connect(self) -> None:
        self.con = self._open()
        for name in ("rows", "steps", "p2p", "buckets", "fsdp"):  # what ``stage`` wrote
            if os.path.isdir(os.path.join(self.directory, name)):
                self._parquet_view(name, os.path.join(self.directory, name))
                self.tables.add(name)

    def _open(self):
        """A connection to the engine, set up for the report."""
        import duckdb

        con = duckdb.connect(":memory:")
        for setting, value in (
            ("memory_limit", self.memory_limit),
            ("temp_directory", os.path.join(self.directory, "spill")),
            ("preserve_insertion_order", "false"),
        ):
            con.execute(f"SET {setting}='{value}'")
        if self.threads:
            con.execute(f"SET threads={int(self.threads)}")
        return con

    def _parquet_view(self, name: str, directory: str) -> None:
        """A view ``name`` of the Parquet files in ``directory``."""
        pattern = os.path.join(directory, "*.parquet").replace("'", "''")
        self.con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{pattern}')")

    # ---- what another SQL engine (analysis.spark) does its own way ------------------------------
    # the reach of each group's members (``_reach``: g, lo, hi, expected) joined to a collective
    _REACH_JOIN = "ASOF JOIN _reach e ON c.g = e.g AND c.cseq >= e.lo"

    @staticmethod
    def _errors() -> tuple:
        """The exceptions of the engine that mean it could not compute the report."""
        import duckdb

        return (duckdb.Error,)

    @staticmethod
    def _out_of_memory() -> tuple:
        """The exceptions of the engine that mean a query ran out of its memory limit."""
        import duckdb

        return (duckdb.OutOfMemoryException,)

    @staticmethod
    def _message(exc: BaseException) -> str:
        """What the report says of the engine's exception ``exc``."""
        return str(exc)

    def _guard(self, function, *args):
        try:
            return function(*args)
        except self._errors() as exc:
            raise EngineError(self._message(exc)) from exc

    def _table(self, name: str, frame) -> None:
        """A table ``name`` holding the pandas DataFrame ``frame``."""
        self.con.register("_frame", frame)
        try:
            self.con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM _frame")
        finally:
            self.con.unregister("_frame")

    def _decode(self, df, column, codes_of):
        """Replace the codes of ``df[column]`` by their names."""
        names = self.names.get(codes_of, {})
        df[column] = _per_distinct(df[column], lambda c: names.get(int(c), ""))  # a missing value: None
        return df

    def _df(self, sql, *params):
        return self.con.execute(sql, list(params)).df()

    # ---- results -----------------------------------------------------------------------------
    def results(self, top: int = 10, arrivals_bins: int | None = None) -> Results:
        """Every table of the report; ``arrivals_bins``: also the per-rank arrival matrix (plots)."""
        warn_refused(self.pattern, stacklevel=3)
        return self._guard(self._results, top, arrivals_bins)

    def _results(self, top, arrivals_bins) -> Results:
        import pandas as pd

        if self.con is None:
            self._connect()
        if "rows" not in self.tables:
            raise ValueError("no rows were given to the engine")
        ranks = sorted(self.seen_ranks)
        if len(ranks) > 1:  # before the summary: its bandwidth is from the transfer time
            self._groups(ranks)
            self._match()
        per_step = self._per_step()
        bus_by = ["collective", "size_bucket"]  # the findings compare the bus bandwidth of the steady state by these
        steady = self._steady_where(per_step)
        if self.by == bus_by:  # both from one scan
            summary, bus = self._summary(None, also=steady)
        else:
            summary, bus = self._summary(None), self._summary(bus_by, steady, sums_only=True)
        out = Results(summary=summary, per_step=per_step, rank_list=ranks, **self.counts)
        members = set()  # with one rank's log too: the members named are the job's (a host left out)
        for s in self.group_ranks.values():
            members.update(expand_ranks(s))
        out.missing_logs = sorted(members - set(ranks))
        out.bus_summary = bus
        out.setup, out.ops, out.unmeasured_ops = self._row_facts(out.per_step)
        if "steps" in self.tables:
            # the rows and columns the per-rank table reads (advice.rank_steps: the steady state's); every
            # column cost 3.5 s at 1,024 x 25,000 rows, the stage as text per row 0.7 s of 1.1
            cols = [c for c in RANK_STEPS_READS if c != "stage"]
            steady_rows = self._df(f"SELECT {', '.join(cols)} FROM steps WHERE stage = 'steady' ORDER BY rank, step")
            out.by_rank_steps = steady_rows.assign(
                stage=pd.Categorical.from_codes(np.zeros(len(steady_rows), np.int8), ["steady"])
            )
        out.hangs = self._hangs()
        out.advice_rows, out.left_out = self._advice_rows(steady)
        out.job = sorted(self.job, key=lambda j: j["rank"])
        if len(ranks) > 1:
            out.ranks = self._rank_table()
            out.log_ends = self.log_ends
            out.clock = dict(sorted(self.clock.items()))
            out.step_arrivals = self._step_arrivals()
            out.position_arrivals = self._position_arrivals(per_step)
            out.p2p_steps = self._p2p_steps()
            skew = self._top_skew(top)
            out.p2p = self._p2p()
            # one scan for the rows of every collective shown: the top skews, those whose fields
            # disagree (when few) and the first missing one of each group
            wanted = pd.concat(
                [
                    skew.rename(columns={"coll_seq": "cseq"})[["g", "cseq"]],
                    self._df("SELECT g, cseq FROM coll WHERE differs LIMIT " + str(self.SMALL_DIFFERS + 1)),
                    self._df("SELECT g, min(cseq) AS cseq FROM coll WHERE missing GROUP BY g"),
                ]
            )
            shown = self._shown(wanted)
            names = self.names.get("group", {})

            def flags_of(differs):
                out = {c: [] for c in ("g", "cseq", "op_mismatch", "dtype_mismatch", "bytes_mismatch")}
                for g, cseq in zip(differs["g"], differs["cseq"]):
                    rows = shown[(names[int(g)], int(cseq))]
                    for column, values in (
                        ("g", g),
                        ("cseq", cseq),
                        ("op_mismatch", rows["op"].nunique() > 1),
                        ("dtype_mismatch", rows["dtype"].nunique() > 1),
                        ("bytes_mismatch", rows["bytes"].nunique() > 1),
                    ):
                        out[column].append(values)
                return pd.DataFrame(out)

            found = self._mismatches(flags_of)
            missing_rows = [(f[2], f[3]) for f in found if (f[1], f[3]) not in shown]
            if missing_rows:  # first disagreements of a long run of them (computed in SQL)
                shown.update(self._shown(pd.DataFrame(missing_rows, columns=["g", "cseq"])))
            first = {key: rows.iloc[0] for key, rows in shown.items()}
            skew = skew.assign(
                step=[first[(g, c)]["step"] for g, c in zip(skew["group"], skew["coll_seq"])],
                op=[first[(g, c)]["op"] for g, c in zip(skew["group"], skew["coll_seq"])],
                bytes=[first[(g, c)]["bytes"] for g, c in zip(skew["group"], skew["coll_seq"])],
                max_duration_us=[shown[(g, c)]["dur"].max() for g, c in zip(skew["group"], skew["coll_seq"])],
            )
            out.skew = skew[
                ["group", "coll_seq", "step", "op", "bytes", "ranks", "skew_us", "straggler", "max_duration_us"]
            ]
            collectives = [
                (kind, name, cseq, int(first[(name, cseq)]["step"]), str(first[(name, cseq)]["op"]), n)
                for kind, name, g, cseq, n in found
            ]
            out.mismatches = mismatch_table(
                collectives, lambda group, coll_seq: shown[(group, coll_seq)], self.p2p_firsts, set(ranks)
            )
            if arrivals_bins:
                out.arrivals = self._arrivals(arrivals_bins)
        return out

    def _transfer_source(self, table: str = "rows", group: str = '"group"') -> str:
        """``table`` with the arrival-free transfer time of each row (``transfer``: matching.transfer_times),
        once the collectives are matched; ``group``: its column of group codes."""
        if self.matched is None:
            return f"(SELECT *, own AS transfer FROM {table})"
        return f"""(
            SELECT r.*, CASE WHEN c.complete AND r.host AND (r.start_ns - c.ls) / 1e3 + r.dur > 0
                             THEN least(r.own, (r.start_ns - c.ls) / 1e3 + r.dur) ELSE r.own END AS transfer
            FROM {table} r LEFT JOIN coll c ON r.{group} = c.g AND r.cseq = c.cseq)"""

    def _advice_rows(self, steady: str):
        """(rows, left out): what the advice rules that read rows (advice.ROW_RULES) read of them, with
        the columns they read: DDP's bucket rows whole, and the steady-state calls with bytes that are
        no bucket (``steady``: their condition in SQL), when at most ADVICE_ROWS; else those are left
        out, and the text says so."""
        import pandas as pd

        parts, left_out = [], ""
        for table in ("buckets", "fsdp"):  # read whole
            if table in self.tables:
                b = self._df(f"SELECT * FROM {self._transfer_source(table, 'g')} ORDER BY rank, start_ns")
                b["transfer_us"] = b.pop("transfer")
                parts.append(b.drop(columns=["g", "cseq", "own", "dur", "host"]))
        where = f"NOT bucketed AND NOT fsdp_gather AND bytes > 0 AND {steady}"
        n = self.con.execute(f"SELECT count(*) FROM rows WHERE {where}").fetchone()[0]
        if n > ADVICE_ROWS:
            left_out = ENGINE_LEFT_OUT.format(rows=n, most=ADVICE_ROWS)
        elif n:
            r = self._df(f"""
                SELECT rank, seq, step, op, "group", bytes, start_ns, dur AS duration_us, own AS own_us,
                       transfer AS transfer_us
                FROM {self._transfer_source()} WHERE {where} ORDER BY rank, step, start_ns""")
            self._decode(r, "op", "op")
            self._decode(r, "group", "group")
            r["collective"] = _per_distinct(r["op"], lambda op: describe_op(op)[0])
            r["async_op"] = False  # no bucket (the mask the rules apply: steps._bucket_mask)
            parts.append(r)
        if not parts:
            return None, left_out
        out = pd.concat(parts, ignore_index=True)
        if "bucket" in out.columns:
            out["bucket"] = out["bucket"].fillna(-1).astype(np.int64)
        for column in ("op", "collective", "group", "device"):
            if column in out.columns:
                out[column] = out[column].fillna("").astype(str).astype("category")
        return out, left_out

    def _hangs(self):
        """``hangs.hangs``'s table from the ranks' digests (each a few rows and counts) and flights; the
        k-th send of a pair, when one was never received, from the p2p table."""
        if any(d is None for d in self.digests):  # read with a window of steps, as hangs.hangs says
            return _hangs.empty()
        flights = merge_flights(self.flights)
        d = _hangs.concat(self.digests)
        p2p = d.counts[d.counts["op"].isin(list(P2P_SIDES)) & (d.counts["peer"] >= 0)]
        unmatched = _hangs._unmatched_sends(p2p, set(self.seen_ranks), self._kth_send)
        return _hangs.from_digest(d, flights, unmatched)

    def _kth_send(self, rank: int, peer: int, group: str, channel: str, k: int) -> tuple:
        """(op, start_ns) of ``rank``'s k-th send to ``peer`` on (group, channel), as ``hangs._kth_send``."""
        row = self.con.execute(
            'SELECT op, start_ns FROM p2p WHERE "group" = ? AND channel = ? AND src = ? AND dst = ? AND side = 0 '
            "AND k = ?",
            [code_of(group), int(channel == "tensor"), rank, peer, k],
        ).fetchone()
        return self.names["op"][int(row[0])], int(row[1])

    def summary(self, by=None):
        """``summaries.summary`` of every row added, by the engine's ``by`` keys (default) or by
        columns it stores (op, group, dtype, rank, step) and size_bucket."""
        if self.con is None:
            self._connect()
        return self._guard(self._summary, by)

    def arrivals(self, bins: int = 200):
        """The per-rank arrival matrix of the plots (``matching.arrival_matrix``), after ``results()``."""
        return self._guard(self._arrivals, bins)

    def _summary(self, by, where: str = "true", sums_only: bool = False, also: str | None = None):
        """The summary by ``by``, of the rows ``where`` says; ``sums_only``: without the mean, the
        quantiles and the maximum (NaN), for the bandwidth only (a quantile holds every duration).
        ``also``: a condition; then (the summary, the bandwidth by the same keys of the rows ``also`` says),
        from the same scan (its bandwidth columns only)."""
        by = self.by if by is None else ([by] if isinstance(by, str) else list(by))
        exprs: list[tuple[str, str | None]] = []
        for i, key in enumerate(by):
            if by is self.by:
                exprs.append((f"k{i}", f"k{i}"))
            elif key == "collective" and "collective" in self.by:
                exprs.append((f"k{self.by.index('collective')}", f"k{self.by.index('collective')}"))
            elif key == "collective":  # derived from the op, as data.ops.describe_op names it
                cases = " ".join(
                    f"WHEN {code} THEN '{describe_op(name)[0]}'" for code, name in self.names.get("op", {}).items()
                )
                exprs.append((f"CASE op {cases} END" if cases else "NULL", None))
            elif key == "size_bucket":
                exprs.append(("CASE WHEN bytes > 0 THEN pow(2.0, ceil(log2(bytes)))::BIGINT ELSE 0 END", None))
            elif key in ("op", "group", "dtype", "rank", "step"):
                exprs.append((f'"{key}"', key if key in _CAT_COLUMNS else None))
            else:
                raise ValueError(f"the engine's summary is by {', '.join(self.by)} or by stored columns, not {key!r}")
        keys = [f"_k{i}" for i in range(len(by))]
        cols = ", ".join(f"{e} AS {k}" for (e, _), k in zip(exprs, keys))
        source = self._transfer_source()

        # each value to sum is made exact once, in the scan, and summed by every aggregate that needs it
        # (a cast in each aggregate: 4.2 s against 3.6 s at 25.6 M rows, the same sums)
        exact = ", ".join(f"CASE WHEN isfinite({x}) THEN ({x})::{_EXACT} END AS _x_{x}" for x in _SUMMED)
        scan = f"SELECT {cols}, dur, bytes, {exact}{f', ({also}) AS _w' if also else ''} FROM {source} WHERE {where}"

        def sums(prefix: str = "", w: str | None = None) -> str:
            only = f" FILTER (WHERE {w})" if w else ""
            measured = f" FILTER (WHERE {w} AND dur IS NOT NULL)" if w else " FILTER (WHERE dur IS NOT NULL)"

            def total(x):
                return f"coalesce((sum(_x_{x}){only})::DOUBLE, 0)"

            own = "" if w else f"{total('own')} AS {prefix}own_us, sum(bytes)::BIGINT AS {prefix}bytes, "
            return f"""count(*){only} AS {prefix}count, {total("dur")} AS {prefix}total_us, {own}
                   {total("transfer")} AS {prefix}transfer_us,
                   (count(*){only} - count(dur){only})::BIGINT AS {prefix}unmeasured,
                   coalesce((sum(bytes){measured})::DOUBLE, 0) AS {prefix}_mbytes,
                   {total("busbytes")} AS {prefix}_busbytes"""

        stats = (
            "NULL::DOUBLE AS mean_us, NULL AS _q, NULL::DOUBLE AS max_us"
            if sums_only
            else "sum(_x_dur)::DOUBLE / count(_x_dur) AS mean_us, quantile_cont(dur, [0.5, 0.95]) AS _q, max(dur) AS max_us"
        )
        # of the rows ``also`` says (``_w``), the bandwidth's sums and the time (the headline's top
        # collective) only
        query = f"""
            SELECT {", ".join(keys)}, {sums()}, {stats}{f", {sums('_w_', '_w')}" if also else ""}
            FROM ({scan}) GROUP BY ALL"""
        try:
            raw = self._df(query)
        except self._out_of_memory():  # a quantile state holds every duration of its group, in memory
            if sums_only:
                raise
            raw = self._df(query.replace("quantile_cont(dur, [0.5, 0.95]) AS _q", "NULL AS _q"))
            raw["_q"] = self._sorted_quantiles(raw, keys, cols, source, where)
        if also is None:
            return self._finish_summary(raw, by, keys, exprs)
        part = raw[raw["_w_count"] > 0][keys].copy()
        for column in ("count", "transfer_us", "total_us", "unmeasured", "_mbytes", "_busbytes"):
            part[column] = raw.loc[part.index, f"_w_{column}"]
        # (not summed: NaN, unknown)
        part["own_us"] = part["mean_us"] = part["max_us"] = np.nan
        part["bytes"], part["_q"] = 0, None
        return self._finish_summary(raw, by, keys, exprs), self._finish_summary(part, by, keys, exprs)

    def _sorted_quantiles(self, raw, keys, cols, source, where) -> list:
        """[p50, p95] of each row of ``raw`` (a summary by ``keys``) as ``quantile_cont`` gives them,
        from a sort of the durations (which spills to disk) instead of a state holding them all in
        memory: 164 M rows in a few groups exceeded the engine's 2 GB at 16,384 ranks x 10,000 rows."""
        on = " AND ".join(f"v.{k} IS NOT DISTINCT FROM n.{k}" for k in keys)
        found = self._df(f"""
            WITH v AS (SELECT {cols}, dur FROM {source} WHERE ({where}) AND dur IS NOT NULL),
                 n AS (SELECT {", ".join(keys)}, count(*) AS n FROM v GROUP BY ALL),
                 r AS (SELECT v.*, n.n, row_number() OVER (PARTITION BY {", ".join(f"v.{k}" for k in keys)}
                                                          ORDER BY v.dur) - 1 AS i
                       FROM v JOIN n ON {on})
            SELECT {", ".join(keys)}, n, i, dur FROM r
            WHERE i IN (floor((n - 1) * 0.5), ceil((n - 1) * 0.5), floor((n - 1) * 0.95), ceil((n - 1) * 0.95))""")
        quantiles = []
        for _, part in found.groupby(keys, dropna=False, sort=False):
            n, value = int(part["n"].iloc[0]), dict(zip(part["i"].astype(np.int64), part["dur"].astype(np.float64)))
            q = []
            for p in (0.5, 0.95):
                h = (n - 1) * p
                lo, hi = value[math.floor(h)], value[math.ceil(h)]
                q.append(lo + (h - math.floor(h)) * (hi - lo))
            quantiles.append(part[keys].iloc[:1].assign(_q=[q]))
        if not quantiles:
            return [None] * len(raw)
        import pandas as pd

        merged = raw[keys].merge(pd.concat(quantiles, ignore_index=True), on=keys, how="left")  # (NaN keys meet)
        return [q if isinstance(q, list) else None for q in merged["_q"]]  # no duration in a group: None

    def _finish_summary(self, out, by, keys, exprs):
        import pandas as pd

        for k, (_, codes_of) in zip(keys, exprs):
            if codes_of is not None and codes_of in self.names:  # categorical: names, in pandas' order
                names = self.names[codes_of]
                values = [names[int(c)] for c in out[k]]
                out[k] = pd.Categorical(values, categories=sorted(set(values)))
        # one quantile state for both (each holds every duration of its group: two did not fit in 2 GB at 100M rows)
        # a group of calls none of which has a duration: no quantiles (pandas' NA, not a list)
        q = [v if isinstance(v, (list, tuple, np.ndarray)) and len(v) == 2 else [np.nan, np.nan] for v in out["_q"]]
        out["p50_us"] = np.array([v[0] for v in q], np.float64)
        out["p95_us"] = np.array([v[1] for v in q], np.float64)
        out = out.sort_values(keys, kind="stable").rename(columns=dict(zip(keys, by)))
        out["count"] = out["count"].astype(np.int64)
        out = out.set_index(by)[
            [
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
                "_mbytes",
                "_busbytes",
            ]
        ]
        return finish_summary(out)

    def _per_step(self):
        """``summaries.per_step(by_rank=False)`` from the per-rank tables ``stage`` wrote."""
        if "steps" not in self.tables:
            return None
        out = self._df(f"""
            SELECT step, arg_min(stage, rank) AS stage, arg_min(step_source, rank) AS step_source,
                   count(*)::BIGINT AS ranks, avg(calls) AS calls, avg(unmeasured) AS unmeasured, avg(bytes) AS bytes, {_avg("comm_us")} AS comm_us,
                   max(comm_us) AS max_comm_us, {_avg("busy_us")} AS busy_us, {_avg("exposed_us")} AS exposed_us,
                   {_avg("overlapped_us")} AS overlapped_us, {_avg("overlap_unknown_us")} AS overlap_unknown_us,
                   {_avg("setup_comm_us")} AS setup_comm_us, {_avg("ddp_finalize_us")} AS ddp_finalize_us,
                   {_avg("ddp_pack_us")} AS ddp_pack_us, {_avg("step_us")} AS step_us,
                   arg_min(step_time_from, rank) AS step_time_from, {_avg("comm_share")} AS comm_share,
                   {_avg("exposed_share")} AS exposed_share,
                   (-max({{'c': coalesce(comm_us, '-infinity'::DOUBLE), 'r': -rank}}).r)::BIGINT AS max_rank
            FROM steps GROUP BY step ORDER BY step""")
        return out

    @staticmethod
    def _steady_where(steps_table) -> str:
        """The rows of the steady state (set-up calls left out, as ``steps.steady_rows``), else every
        row: the condition in SQL."""
        if steps_table is None or not (steps_table["stage"] == "steady").any():
            return "true"
        # the steps not in the steady state: a few (set-up, the last), where the steady ones are many
        other = ", ".join(str(int(x)) for x in steps_table.loc[steps_table["stage"] != "steady", "step"])
        where = f"op NOT IN ({', '.join(str(code_of(op)) for op in SETUP_OPS)})"
        return where + (f" AND step NOT IN ({other})" if other else "")

    def _row_facts(self, steps_table):
        """What the findings read of the rows, in one scan: ``steps.setup_cost`` (the communication of
        set-up calls and of set-up steps, per op), the ops of the rows and those of the steady-state
        calls without a duration (set-up calls left out, as ``steps.steady_rows``): sorted names."""
        import pandas as pd

        stages = pd.DataFrame({"step": np.zeros(0, np.int64), "stage": np.zeros(0, object)})
        if steps_table is not None:
            stages = pd.DataFrame(
                {"step": steps_table["step"].astype(np.int64), "stage": steps_table["stage"].astype(str)}
            )
        setup_ops = ", ".join(str(code_of(op)) for op in SETUP_OPS)
        in_setup = f"(r.op IN ({setup_ops}) OR s.stage = 'setup')"
        self.con.register("_stages", stages)
        try:
            per_op = self._df(f"""
                SELECT r.op, coalesce({_sum("r.dur")}, 0) AS us,
                       coalesce({_sum(f"CASE WHEN {in_setup} THEN r.dur END")}, 0) AS setup_us,
                       bool_or({in_setup}) AS in_setup,
                       bool_or(r.dur IS NULL AND s.stage = 'steady' AND r.op NOT IN ({setup_ops})) AS unmeasured
                FROM rows r LEFT JOIN _stages s ON r.step = s.step GROUP BY r.op""")
        finally:
            self.con.unregister("_stages")
        names = self.names.get("op", {})
        per_op["op"] = [names[int(c)] for c in per_op["op"]]
        per_op = per_op.sort_values("op", kind="stable")
        ops, unmeasured = per_op["op"].tolist(), per_op.loc[per_op["unmeasured"].fillna(False), "op"].tolist()
        if steps_table is None:
            return None, ops, unmeasured
        part = per_op[per_op["in_setup"].fillna(False)]
        by_op = pd.Series(part["setup_us"].to_numpy(np.float64), index=pd.Index(part["op"], name="op"))
        total = math.fsum(per_op["us"])  # (exact sums per op: the same in any order)
        return (
            setup_from(steps_table, by_op, total, len(self.seen_ranks), self.counts["unmeasured"] > 0),
            ops,
            unmeasured,
        )

    def _groups(self, ranks) -> None:
        """Per group code: its name's position in sorted order (how pandas orders categories) and
        the members of the group that have a log here."""
        import pandas as pd

        codes = list(self.names.get("group", {}))
        names = [self.names["group"][c] for c in codes]
        present = set(ranks)
        order = {n: i for i, n in enumerate(sorted(names))}
        g = pd.DataFrame(
            {
                "g": np.array(codes, np.int64),
                "name": names,
                "pos": [order[n] for n in names],
                "expected": [sum(r in present for r in expand_ranks(self.group_ranks.get(n, ""))) for n in names],
                "members": [len(expand_ranks(self.group_ranks.get(n, ""))) for n in names],
            }
        )
        self._table("groups", g)

    # the first / last arrival of a collective: the earliest / latest issue time, ties broken by rank
    # as the pandas path sorts them (a 128-bit key: 20 bits of rank below the time)
    @staticmethod
    def _order(alias: str = "") -> str:
        """The arrival order of rows (issue time, then rank: as matching sorts them), of table ``alias``."""
        at = f"{alias}." if alias else ""
        return f"({at}start_ns::HUGEINT * 1048576 + {at}rank)"

    def _match(self) -> None:
        """One row per collective (group, cseq) with the few aggregates every row must feed (measured
        at 256 ranks x 100k rows: a struct of the first arrival's values made this 5x slower); the
        first arrival's values and which field differs are looked up afterwards for the few
        collectives the report shows (``_mismatches``, ``_shown``). The members expected in each
        collective are those whose log reaches it (``matching.reach_steps``: a log that ends early
        ends its rank's matching, it makes no mismatch)."""
        self._reach()
        self._table("_reach", self.reach)
        self.con.execute(f"""
            CREATE OR REPLACE TABLE coll AS
            SELECT c.*, (ls - fs) / 1e3 AS skew_us, n < e.expected AS missing, g.expected - e.expected AS ended,
                   n = g.members AS complete, g.pos
            FROM (SELECT "group" AS g, cseq, count(*) AS n, min(start_ns) AS fs, max(start_ns) AS ls,
                         arg_max(rank, {self._order()}) AS straggler, arg_max(step, {self._order()}) AS sstep,
                         min(hash(op, dtype, bytes)) <> max(hash(op, dtype, bytes)) AS differs
                  FROM rows WHERE cseq >= 0 GROUP BY "group", cseq) c
            JOIN groups g ON c.g = g.g
            {self._REACH_JOIN}""")
        self.matched = True
        tail = self._df("SELECT g, max(cseq) AS last, count(*) AS n FROM coll WHERE ended > 0 GROUP BY g")
        names = self.names.get("group", {})
        self.log_ends = log_end_rows(
            sorted(
                (names[int(g)], self.by_group.get(int(g), {}), int(last), int(n))
                for g, last, n in zip(tail["g"], tail["last"], tail["n"])
            )
        )

    def _reach(self) -> None:
        """``matching.reach_steps`` of every group, as a table (g, lo, expected) for an ASOF join."""
        import pandas as pd

        # one scan (three were 0.74 s against 0.47 s at 25.6 M rows): per group and rank, where its
        # collectives end, and its first and last issue times (no NULL: integers stay exact in pandas)
        none = np.iinfo(np.int64).max
        facts = self._df(
            'SELECT "group" AS g, rank::BIGINT AS rank, coalesce(max(cseq) FILTER (WHERE cseq >= 0) + 1, 0) AS n, '
            f"max(start_ns) AS t, coalesce(min(start_ns) FILTER (WHERE cseq >= 0), {none}) AS first "
            "FROM rows GROUP BY ALL"
        )
        ends = facts[facts["n"] > 0]
        last = facts.groupby("rank", sort=True)["t"].max().reset_index()
        self._table("_last", last)
        last_ns = dict(last.itertuples(index=False, name=None))
        first = facts[facts["first"] != none].groupby("g")["first"].min()
        first_ns = dict(zip(first.index.tolist(), first.tolist()))
        self.counts_of = {(int(g), int(r)): int(n) for g, r, n in zip(ends["g"], ends["rank"], ends["n"])}
        self.by_group = counts_by_group(self.counts_of)
        present = set(self.seen_ranks)
        rows = []
        for code, name in self.names.get("group", {}).items():
            if code not in first_ns:
                continue
            members = [r for r in expand_ranks(self.group_ranks.get(name, "")) if r in present]
            alive = {r for r in members if last_ns.get(r, -1) > first_ns[code]}
            rows += [(code, lo, n) for lo, n in reach_steps(members, self.by_group.get(code, {}), alive)]
        reach = pd.DataFrame(rows, columns=["g", "lo", "expected"]).astype(np.int64).sort_values(["g", "lo"])
        # where the next reach of the group starts (an engine without an ASOF join joins on the range)
        reach["hi"] = reach.groupby("g")["lo"].shift(-1).fillna(2**62).astype(np.int64)
        self.reach = reach.reset_index(drop=True)

    def _join_wanted(self, wanted, sql):
        """Run ``sql`` (which joins ``rows r`` with ``_want w`` on group and cseq) for the collectives
        ``wanted`` (a DataFrame with g, cseq)."""
        self.con.register("_want", wanted[["g", "cseq"]].drop_duplicates())
        try:
            return self._df(sql)
        finally:
            self.con.unregister("_want")

    def _rank_table(self):
        out = self._df(f"""
            SELECT r.rank::BIGINT AS rank, count(*)::BIGINT AS collectives,
                   coalesce({_sum("CASE WHEN r.dur IS NULL THEN NULL ELSE least((c.ls - r.start_ns) / 1e3, r.dur) END")}, 0)
                       AS wait_us,
                   coalesce({_sum("r.dur")}, 0) AS measured_us
            FROM rows r JOIN coll c ON r."group" = c.g AND r.cseq = c.cseq
            GROUP BY r.rank ORDER BY r.rank""")
        last = self._df(f"""SELECT straggler::BIGINT AS rank, count(*)::BIGINT AS last_count, {_sum("skew_us")} AS late_us
                           FROM coll WHERE n > 1 GROUP BY straggler""")
        out = out.merge(last, on="rank", how="left")
        out["last_count"] = out["last_count"].fillna(0).astype(np.int64)
        out["late_us"] = out["late_us"].fillna(0.0)
        out["last_share"] = out["last_count"] / out["collectives"].where(out["collectives"] > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            out["wait_share"] = out["wait_us"] / out["measured_us"].where(out["measured_us"] > 0)
        out = out[
            ["rank", "collectives", "last_count", "last_share", "late_us", "wait_us", "measured_us", "wait_share"]
        ]
        return out.sort_values(["late_us", "last_count"], ascending=False, kind="stable").reset_index(drop=True)

    def _step_arrivals(self):
        """``stragglers.step_arrivals`` in SQL: per step and rank, the longest time the rank alone held up
        one of the step's collectives of two or more ranks (its issue time minus the latest other rank's:
        the second-latest when it was the last)."""
        # the second-latest issue time of each collective (l2): the latest of the ranks but the last
        # one (a top-2 aggregate in the ``coll`` scan kept a list per collective: out of memory at
        # 1,024 ranks x 25,000 rows within the engine's 2 GB); the last one held the others up by
        # ls - l2 in its step (``sstep``). Without any known release (NCCL, async calls): one scan of
        # the rows for l2 and the count of collectives per (step, rank) (grouping sets: 3.9 s against
        # 6.6 s for two joins at 25.6 M rows). With them, less how much later the last rank was
        # released by its last blocking rooted collective than the second-latest (its row: the highest rank
        # of those issued at l2, as matching orders them) was by the same one (matching.late_released;
        # ``rel`` / ``pkey``, staged; null where unknown).
        # the held time of each collective is kept (``_cheld``: group, cseq, step, last rank, held_us,
        # n) for the evidence at each collective's place in the step (``_position_arrivals``)
        if not self.released:
            self.con.execute("""
                CREATE OR REPLACE TEMP TABLE _a AS
                SELECT c.g, c.cseq, r.step, r.rank, grouping(c.g) AS gs,
                       max(r.start_ns) FILTER (WHERE r.rank <> c.straggler) AS l2,
                       count(*) FILTER (WHERE c.n > 1) AS k
                FROM rows r JOIN coll c ON r."group" = c.g AND r.cseq = c.cseq
                GROUP BY GROUPING SETS ((c.g, c.cseq), (r.step, r.rank))""")
            self.con.execute("""
                CREATE OR REPLACE TEMP TABLE _cheld AS
                SELECT c.g, c.cseq, c.sstep AS step, c.straggler AS rank, greatest(c.ls - a.l2, 0) / 1e3 AS held_us, c.n
                FROM _a a JOIN coll c ON a.g = c.g AND a.cseq = c.cseq WHERE a.gs = 0 AND c.n > 1""")
            try:
                return self._df("""
                    WITH held AS (SELECT step, rank, max(held_us) AS held_us FROM _cheld GROUP BY ALL)
                    SELECT a.step, a.rank::BIGINT AS rank, coalesce(h.held_us, 0.0) AS held_us, a.k::BIGINT AS collectives
                    FROM _a a LEFT JOIN held h ON a.step = h.step AND a.rank = h.rank
                    WHERE a.gs = 1 AND a.k > 0 ORDER BY a.step, rank""")
            finally:
                self.con.execute("DROP TABLE IF EXISTS _a")
        other, mine = "FILTER (WHERE r.rank <> c.straggler)", "FILTER (WHERE r.rank = c.straggler)"
        order = self._order("r")
        # one statement each (the held times, then the counts beside them): together they ran out of
        # the memory limit where each alone does not (64 ranks x 20,000 rows within 64 MB)
        self.con.execute(f"""
            CREATE OR REPLACE TEMP TABLE _cheld AS
            WITH a AS (
                SELECT c.g, c.cseq, max(r.start_ns) {other} AS l2,
                       arg_max_null(r.rel, {order}) {other} AS orel, arg_max_null(r.pkey, {order}) {other} AS okey,
                       max(r.rel) {mine} AS srel, max(r.pkey) {mine} AS skey
                FROM rows r JOIN coll c ON r."group" = c.g AND r.cseq = c.cseq WHERE c.n > 1 GROUP BY c.g, c.cseq)
            SELECT c.g, c.cseq, c.sstep AS step, c.straggler AS rank,
                   greatest(c.ls - a.l2 - CASE WHEN a.skey = a.okey THEN greatest(a.srel - a.orel, 0) ELSE 0 END,
                            0) / 1e3 AS held_us, c.n
            FROM a JOIN coll c ON a.g = c.g AND a.cseq = c.cseq""")
        return self._df("""
            WITH k AS (
                SELECT r.step, r.rank, count(*) AS k FROM rows r JOIN coll c ON r."group" = c.g AND r.cseq = c.cseq
                WHERE c.n > 1 GROUP BY ALL),
            held AS (SELECT step, rank, max(held_us) AS held_us FROM _cheld GROUP BY ALL)
            SELECT k.step, k.rank::BIGINT AS rank, coalesce(h.held_us, 0.0) AS held_us, k.k::BIGINT AS collectives
            FROM k LEFT JOIN held h ON k.step = h.step AND k.rank = h.rank ORDER BY k.step, rank""")

    def _position_arrivals(self, steps_table):
        """``stragglers.position_candidates`` of ``stragglers.position_arrivals`` in SQL, from the held
        time of each collective (``_cheld``, left by ``_step_arrivals``): the steady-state collectives
        of the groups with a position where one rank held the collective up in at least half of the
        steps, and the number of (position, rank) pairs; None without steady-state steps."""
        import pandas as pd

        try:
            if steps_table is None or not (steps_table["stage"] == "steady").any():
                return None
            other = ", ".join(str(int(x)) for x in steps_table.loc[steps_table["stage"] != "steady", "step"])
            self.con.execute(f"""
                CREATE OR REPLACE TEMP TABLE _pos AS
                SELECT * FROM (
                    SELECT g, cseq, step, rank, held_us, n,
                           row_number() OVER (PARTITION BY g, step ORDER BY cseq) - 1 AS pos
                    FROM _cheld) h
                WHERE {f"step NOT IN ({other})" if other else "true"}""")
            self.con.execute("""
                CREATE OR REPLACE TEMP TABLE _per AS
                SELECT p.g, p.pos, p.m, p.n, coalesce(k.k, 0) AS k
                FROM (SELECT g, pos, count(*) AS m, max(n) AS n FROM _pos GROUP BY g, pos) p
                LEFT JOIN (SELECT g, pos, max(k) AS k FROM (
                              SELECT g, pos, rank, count(*) AS k FROM _pos WHERE held_us > 0 GROUP BY g, pos, rank) t
                           GROUP BY g, pos) k
                ON p.g = k.g AND p.pos = k.pos
                WHERE p.m >= 2""")
            tests = int(self._df("SELECT coalesce(sum(n), 0) AS t FROM _per")["t"].iloc[0])
            out = self._df("""
                SELECT p.g, p.cseq, p.step, p.rank::BIGINT AS rank, p.held_us, p.n::BIGINT AS n, p.pos::BIGINT AS pos
                FROM _pos p WHERE p.g IN (SELECT g FROM _per WHERE 2 * k >= m)
                ORDER BY p.g, p.pos, p.step""")
            firsts = out.drop_duplicates(["g", "pos"])  # each position's first collective (ordered by step)
            ops = self._join_wanted(  # their ops (the verdict says it)
                firsts,
                'SELECT DISTINCT r."group" AS g, r.cseq, r.op FROM rows r JOIN _want w ON r."group" = w.g AND r.cseq = w.cseq',
            )
        finally:
            for name in ("_cheld", "_pos", "_per"):
                self.con.execute(f"DROP TABLE IF EXISTS {name}")
        self._decode(ops, "op", "op")
        group_names = self.names.get("group", {})
        op_of = {(int(g), int(c)): str(o) for g, c, o in zip(ops["g"], ops["cseq"], ops["op"])}
        at_first = {
            (int(g), int(p)): op_of.get((int(g), int(c)), "")
            for g, p, c in zip(firsts["g"], firsts["pos"], firsts["cseq"])
        }
        frame = pd.DataFrame(
            {
                "group": [group_names.get(int(g), "") for g in out["g"]],
                "cseq": out["cseq"].to_numpy(np.int64),
                "step": out["step"].to_numpy(np.int64),
                "rank": out["rank"].to_numpy(np.int64),
                "held_us": out["held_us"].to_numpy(np.float64),
                "n": out["n"].to_numpy(np.int64),
                "op": [at_first.get((int(g), int(p)), "") for g, p in zip(out["g"], out["pos"])],
                "pos": out["pos"].to_numpy(np.int64),
            }
        )
        return frame, tests

    def _p2p_steps(self):
        """``matching.p2p_steps`` in SQL: per (step, rank) with a point-to-point call, the issue of its
        first, the time its thread waited in them, and how long its receives waited for their sends by
        the issue times; None without matched pairs."""
        if "p2p" not in self.tables:
            return None
        # each receive beside its send in the one scan that groups the calls (a join of the receives with
        # the sends, then of its table with the grouped calls: 1.6-2.6 s against 1.4-1.5 s at 5.1 M calls)
        out = self._df("""
            SELECT p.step::BIGINT AS step, (CASE WHEN p.side = 0 THEN p.src ELSE p.dst END)::BIGINT AS rank,
                   min(p.start_ns)::BIGINT AS first_ns, (sum(p.wait) FILTER (WHERE NOT isnan(p.wait)))::DOUBLE AS wait_us,
                   coalesce(sum(greatest(s.start_ns - p.start_ns, 0)), 0)::DOUBLE / 1e3 AS recv_wait_us,
                   count(s.k) > 0 AS paired
            FROM p2p p LEFT JOIN (SELECT * FROM p2p WHERE side = 0) s
              ON p.side = 1 AND s."group" = p."group" AND s.channel = p.channel AND s.src = p.src AND s.dst = p.dst
                 AND s.k = p.k
            GROUP BY ALL ORDER BY step, rank""")
        if not out["paired"].any():
            return None
        return out.drop(columns=["paired"])

    def _top_skew(self, n):
        return self._df(f"""
            SELECT c.g, g.name AS "group", c.cseq AS coll_seq, c.n::BIGINT AS ranks, c.skew_us,
                   c.straggler::BIGINT AS straggler
            FROM coll c JOIN groups g ON c.g = g.g
            ORDER BY c.skew_us DESC, c.pos, c.cseq LIMIT {int(n)}""")

    def _pairs_sql(self) -> str:
        return """
            SELECT coalesce(s.g, r.g) AS g, coalesce(s.channel, r.channel) AS channel, coalesce(s.src, r.src) AS src,
                   coalesce(s.dst, r.dst) AS dst, coalesce(s.k, r.k) AS k, s.op AS send_op, r.op AS recv_op,
                   s.bytes AS send_bytes, r.bytes AS recv_bytes,
                   abs(s.start_ns - r.start_ns) / 1e3 AS skew_us, coalesce(s.start_ns, r.start_ns) AS t,
                   s.k IS NOT NULL AND r.k IS NOT NULL AS matched
            FROM (SELECT "group" AS g, * FROM p2p WHERE side = 0) s
            FULL OUTER JOIN (SELECT "group" AS g, * FROM p2p WHERE side = 1) r
              ON s.g = r.g AND s.channel = r.channel AND s.src = r.src AND s.dst = r.dst AND s.k = r.k"""

    def _p2p(self):
        """Point-to-point pairs in one pass: the channels table, and per channel its first unmatched
        call (both ends have a log) and its first size mismatch, from which ``_mismatches`` takes
        the first per group."""
        if "p2p" not in self.tables:
            self.p2p_firsts = []
            return None
        first = """{'channel': p.channel, 'src': p.src, 'dst': p.dst, 'k': p.k, 'send_op': p.send_op,
                    'recv_op': p.recv_op, 'send_bytes': p.send_bytes, 'recv_bytes': p.recv_bytes}"""
        order = "(p.channel, p.src, p.dst, p.k)"
        # and the missing side's log goes on to the other side's issue (matching.mismatches)
        # (both ends have a log: joined with ``_last``, a row per rank with rows; a list of literals
        # in the FILTER was tested per row against every rank: 62 s at 16,384 ranks, 0.6 s joined)
        unmatched = "NOT matched AND ps.rank IS NOT NULL AND pd.rank IS NOT NULL AND l.t >= p.t"
        bytes_bad = "matched AND send_bytes <> recv_bytes"
        out = self._df(f"""
            SELECT g.name AS "group", CASE WHEN p.channel = 0 THEN 'object' ELSE 'tensor' END AS channel,
                   p.src, p.dst, count(*)::BIGINT AS pairs, (count(*) FILTER (WHERE matched))::BIGINT AS matched,
                   (count(*) FILTER (WHERE {bytes_bad}))::BIGINT AS bytes_mismatch,
                   {_avg("skew_us")} AS mean_skew_us, max(skew_us) AS max_skew_us,
                   arg_min({first}, {order}) FILTER (WHERE {unmatched}) AS _unmatched,
                   (count(*) FILTER (WHERE {unmatched}))::BIGINT AS _n_unmatched,
                   arg_min({first}, {order}) FILTER (WHERE {bytes_bad}) AS _bytes
            FROM ({self._pairs_sql()}) p JOIN groups g ON p.g = g.g
            LEFT JOIN _last l ON l.rank = CASE WHEN p.send_op IS NULL THEN p.src ELSE p.dst END
            LEFT JOIN _last ps ON ps.rank = p.src LEFT JOIN _last pd ON pd.rank = p.dst
            GROUP BY g.name, p.channel, p.src, p.dst ORDER BY g.name, channel, p.src, p.dst""")
        ops = self.names.get("op", {})
        self.p2p_firsts = []
        for kind, column, count in (
            (MismatchKind.P2P_UNMATCHED, "_unmatched", "_n_unmatched"),
            (MismatchKind.P2P_BYTES, "_bytes", "bytes_mismatch"),
        ):
            for group, part in out.groupby("group", sort=True):
                part = part[part[count] > 0]  # channels in (channel, src, dst) order: the first is the group's first
                if len(part):
                    first = dict(part[column].iloc[0])
                    for side in ("send_op", "recv_op"):
                        first[side] = ops[first[side]] if first[side] is not None else None
                    self.p2p_firsts.append((kind, str(group), first, int(part[count].sum())))
        return out.drop(columns=["_unmatched", "_n_unmatched", "_bytes"])

    SMALL_DIFFERS = 10_000  # up to this many disagreeing collectives, their rows are fetched with the shown ones

    def _mismatches(self, flags_of):
        """(kind, group name, g, first cseq, affected) per kind and group, as the pandas path orders them.
        ``flags_of(differs)``: which fields differ for the collectives (g, cseq) whose hash disagreed."""
        import pandas as pd

        differs = self._df("SELECT g, cseq FROM coll WHERE differs")
        if len(differs) > self.SMALL_DIFFERS:  # many (a skipped call shifts all later ones): in SQL
            flags = self._df("""
                SELECT c.g, c.cseq, min(r.op) <> max(r.op) AS op_mismatch, min(r.dtype) <> max(r.dtype) AS dtype_mismatch,
                       min(r.bytes) <> max(r.bytes) AS bytes_mismatch
                FROM rows r JOIN (SELECT g, cseq FROM coll WHERE differs) c ON r."group" = c.g AND r.cseq = c.cseq
                GROUP BY ALL""")
        else:
            flags = flags_of(differs)
        flags["missing"] = False
        flags = pd.concat(
            [flags, self._df("SELECT g, cseq, true AS missing FROM coll WHERE missing")], ignore_index=True
        )
        names = self.names.get("group", {})
        found = []
        for kind, flag in MISMATCH_FLAGS:
            bad = flags[flags[flag].fillna(False).astype(bool)]
            per_group = bad.groupby("g")["cseq"].agg(["min", "size"])
            found += sorted(
                (kind, names[int(g)], int(g), int(r["min"]), int(r["size"])) for g, r in per_group.iterrows()
            )
        return found

    def _shown(self, wanted):
        """(group name, cseq) -> the rows (rank, op, dtype, bytes, step, dur, start_ns, group_ranks) of the
        collectives in ``wanted`` (g, cseq): one scan for every collective the report shows."""
        rows = self._join_wanted(
            wanted,
            """
            SELECT r."group" AS g, r.cseq, r.rank::BIGINT AS rank, r.op, r.dtype, r.bytes, r.step, r.dur, r.start_ns
            FROM rows r JOIN _want w ON r."group" = w.g AND r.cseq = w.cseq""",
        )
        rows = rows.sort_values(["start_ns", "rank"], kind="stable")  # first arrival first, as pandas orders
        self._decode(rows, "op", "op")
        self._decode(rows, "dtype", "dtype")
        names = self.names.get("group", {})
        out = {}
        for (g, cseq), part in rows.groupby(["g", "cseq"], sort=False):
            name = names[int(g)]
            out[(name, int(cseq))] = part.assign(group_ranks=self.group_ranks.get(name, ""))
        return out

    def _arrivals(self, bins):
        """``matching.arrival_matrix`` in SQL: mean arrival delay per rank and bin of collectives."""
        ncoll = self.con.execute("SELECT count(*) FROM coll").fetchone()[0]
        bins = max(1, min(bins, ncoll))
        out = self._df(f"""
            WITH idx AS (SELECT g, cseq, fs, row_number() OVER (ORDER BY pos, cseq) - 1 AS i FROM coll)
            SELECT r.rank::BIGINT AS rank, ((i * {bins} // {max(ncoll, 1)}) * {ncoll} + {bins} - 1) // {bins} AS bin,
                   {_avg("(r.start_ns - idx.fs) / 1e3")} AS arrival_us, min(r.step)::BIGINT AS step
            FROM rows r JOIN idx ON r."group" = idx.g AND r.cseq = idx.cseq
            GROUP BY ALL""")
        steps = out.groupby("bin")["step"].min()
        out = out.pivot_table(index="rank", columns="bin", values="arrival_us", aggfunc="mean")
        out.columns.name = "collective"
        return bin_steps(out, steps)
