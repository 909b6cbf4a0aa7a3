"""Files, with no runtime state: path templates (``paths``), writing and conversion (``write``),
reading with validation (``read``). Imports ``data`` and ``config`` only."""

from .paths import check_writable, export_path, rank_path
from .reader import (
    LogFileError,
    LogFileNotFoundError,
    LogFileWarning,
    expand,
    file_rank,
    latest_run,
    read,
    read_ranks,
    runs,
)
from .writer import convert, convert_to_dataset, with_schema_version, write, write_bytes

__all__ = [
    "LogFileError",
    "LogFileNotFoundError",
    "LogFileWarning",
    "check_writable",
    "convert",
    "convert_to_dataset",
    "expand",
    "export_path",
    "file_rank",
    "latest_run",
    "rank_path",
    "read",
    "read_ranks",
    "runs",
    "with_schema_version",
    "write",
    "write_bytes",
]
