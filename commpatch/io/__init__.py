"""Files, with no runtime state: path templates (``paths``), writing and conversion (``write``),
reading with validation (``read``). Imports ``data`` and ``config`` only."""

from .paths import check_writable, export_path, rank_path
from .reader import LogFileError, LogFileNotFoundError, LogFileWarning, expand, latest_run, read, runs
from .writer import convert, with_schema_version, write, write_bytes

__all__ = ["LogFileError", "LogFileNotFoundError", "LogFileWarning", "check_writable", "convert", "expand", "export_path",
           "latest_run", "rank_path", "read", "runs", "with_schema_version", "write", "write_bytes"]
