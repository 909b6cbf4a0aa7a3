"""The hot path and what it writes into: process state (``state``), argument readers and the
generated wrappers (``readers``, ``wrapper``), the row writer (``rows``; its common case in C:
``_hot``, an optional extension), timing sources
(``timing``), the in-memory log (``log``) and its sinks and flusher (``sinks``).
Imports ``data`` only; nothing above it."""
