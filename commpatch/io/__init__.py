"""Files, with no runtime state: path templates (``paths``), writing and conversion (``writer``),
reading (``reader``: ``read``, ``read_ranks``) built on finding the files (``discovery``), one
reader per format (``formats``, ``csvlog``), validation (``validation``) and the problems said
(``problems``). Imports ``data`` and ``config`` only."""

from .discovery import expand, file_rank, latest_run, path_list, runs
from .paths import check_writable, export_path, rank_path
from .problems import LogFileError, LogFileNotFoundError, LogFileWarning
from .reader import read, read_ranks
from .writer import convert, convert_to_dataset, with_schema_version, write, write_bytes

__all__ = [
    "LogFileError",
    "LogFileNotFoundError",
    "LogFileWarning",
    "check_writable",
    "convert",
    "convert_to_dataset",
    "expand",
    "path_list",
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
