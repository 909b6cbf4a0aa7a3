"""The lowest layer, shared by the recorder and the readers; no torch import and no runtime state.

- ``ops``:     the op table (names, codes, size rules, bus-bandwidth kinds);
- ``schema``:  the columns (SCHEMA), the packed row (ROW) and its bit fields, range notation of ranks;
- ``logfile``: the binary rank-log format and its parser;
- ``frame``:   columns / DataFrame / Arrow Table built from a parsed rank log.
- ``publish``: how a file is written (a temporary name, never through a link, then its name).
"""
