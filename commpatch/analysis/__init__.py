"""Pure analysis, DataFrame -> DataFrame: per-op summaries and bandwidth (``summaries``); steps,
set-up and steady state, overhead and scaling (``steps``); findings as sentences (``findings``); matching the same collective across ranks, skew, mismatches
(``matching``, ``cross_rank``). Imports ``data`` only: no I/O, no printing, no runtime state."""

from . import findings  # noqa: F401 - the module: findings.findings(df, steps_table, cross)
from .matching import (P2P_OPS, CrossRank, arrival_matrix, collective_seq, cross_rank, match_collectives, match_p2p,
                       mismatches, rank_table, top_skew)
from .pattern import StepPatternWarning, with_pattern_steps
from .steps import (BLOCKING_TIMINGS, SETUP_OPS, per_step, scaling, scaling_by_op, setup_cost, steady_rows,
                    steady_state)
from .summaries import add_bandwidth, durations, size_bucket, summary
from ..data.ops import bus_factor

__all__ = ["BLOCKING_TIMINGS", "CrossRank", "P2P_OPS", "SETUP_OPS", "setup_cost", "steady_rows", "steady_state", "add_bandwidth", "arrival_matrix", "bus_factor",
           "collective_seq", "cross_rank", "durations", "match_collectives", "match_p2p", "mismatches", "per_step",
           "rank_table", "scaling", "scaling_by_op", "size_bucket", "StepPatternWarning", "summary", "top_skew",
           "with_pattern_steps"]
