"""Deprecated alias (one release): cross-rank matching is ``commpatch.analysis.matching``
(``commpatch.analysis.cross_rank``); reading is ``commpatch.io.read``."""

from .analysis.matching import *  # noqa: F401,F403
from .analysis.matching import P2P_OPS, P2P_SIDES, CrossRank, cross_rank  # noqa: F401
from .io.reader import read as read_logs  # noqa: F401
