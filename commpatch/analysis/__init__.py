"""Pure analysis, DataFrame -> DataFrame: per-op summaries, bandwidth, per-step and scaling
tables (``summaries``); matching the same collective across ranks, skew, mismatches
(``matching``, ``cross_rank``). Imports ``data`` only: no I/O, no printing, no runtime state."""

from .matching import (P2P_OPS, CrossRank, arrival_matrix, collective_seq, cross_rank, match_collectives, match_p2p,
                       mismatches, rank_table, top_skew)
from .summaries import (BLOCKING_TIMINGS, add_bandwidth, durations, per_step, scaling, scaling_by_op, size_bucket,
                        summary)
from ..data.ops import bus_factor

__all__ = ["BLOCKING_TIMINGS", "CrossRank", "P2P_OPS", "add_bandwidth", "arrival_matrix", "bus_factor",
           "collective_seq", "cross_rank", "durations", "match_collectives", "match_p2p", "mismatches", "per_step",
           "rank_table", "scaling", "scaling_by_op", "size_bucket", "summary", "top_skew"]
