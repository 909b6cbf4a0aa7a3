"""Pure analysis, DataFrame -> DataFrame: per-op summaries and bandwidth (``summaries``); steps,
set-up and steady state, overhead and scaling (``steps``); findings as sentences (``findings``); matching the same collective across ranks, skew, mismatches
(``matching``, ``cross_rank``). Imports ``data`` only: no I/O, no printing, no runtime state."""

from ..data.ops import bus_factor
from . import findings  # noqa: F401 - the module: findings.findings(df, steps_table, cross)
from .matching import (
    P2P_OPS,
    CrossRank,
    MismatchKind,
    arrival_matrix,
    collective_seq,
    cross_rank,
    match_collectives,
    match_p2p,
    mismatches,
    rank_table,
    top_skew,
    transfer_times,
    with_transfer,
)
from .pattern import StepPatternWarning, with_pattern_steps
from .steps import BLOCKING_TIMINGS, SETUP_OPS, per_step, scaling, scaling_by_op, setup_cost, steady_rows, steady_state
from .summaries import add_bandwidth, durations, size_bucket, summary

# The log's columns the report's analyses read (``io.read(columns=...)`` loads only these for a
# report of a large log; the engine stages them): a column missing here would count as unknown in
# a report read without ``--trace`` and as measured with it (DDP's finalize and packing: issue 23).
# ``tests/test_shares.py`` checks that a report read with these equals one read with every column.
REPORT_COLUMNS = (
    "seq",
    "op",
    "collective",
    "rank",
    "group",
    "group_ranks",
    "group_seq",
    "dtype",
    "bytes",
    "peer",
    "async_op",
    "start_ns",
    "host_us",
    "duration_us",
    "own_us",
    "timing",
    "algbw_gbps",
    "busbw_gbps",
    "step",
    "bucket",
    "bucket_params",
    "device",
    "step_source",
    "sync_end_us",
    "pack_us",
    "pack_alone_us",
    "wait_us",
    "phase",  # FSDP's backward all-gathers (advice.fsdp_reshard)
    "module",
)

__all__ = [
    "BLOCKING_TIMINGS",
    "CrossRank",
    "MismatchKind",
    "P2P_OPS",
    "REPORT_COLUMNS",
    "SETUP_OPS",
    "setup_cost",
    "steady_rows",
    "steady_state",
    "add_bandwidth",
    "arrival_matrix",
    "bus_factor",
    "collective_seq",
    "cross_rank",
    "durations",
    "match_collectives",
    "match_p2p",
    "mismatches",
    "per_step",
    "rank_table",
    "scaling",
    "scaling_by_op",
    "size_bucket",
    "StepPatternWarning",
    "summary",
    "top_skew",
    "transfer_times",
    "with_pattern_steps",
    "with_transfer",
]
