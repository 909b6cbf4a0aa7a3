"""The one table of settings: name, environment variable, type, default, help.

This is the only module that reads ``os.environ`` for settings. Precedence:
``enable(**kwargs)`` > environment > defaults. A bad value raises ``ConfigError``
naming the variable and what is allowed; a bad monitoring setting (``Setting.monitoring``: the
live metrics) never stops a job: given a ``warn`` callback, ``resolve`` says it there and leaves
the setting off.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from typing import Any, Callable

from .data.ops import TARGET_NAMES

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """A commpatch setting has a value that is not allowed."""


def _parse_bool(name: str, env: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(
        f"{env}={value!r} (setting {name!r}) is not a boolean: use one of 1/0, true/false, yes/no, on/off"
    )


def _parse_choice(*allowed: str) -> Callable[[str, str, Any], str]:
    def parse(name: str, env: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise ConfigError(f"{env}={value!r} (setting {name!r}) is not allowed: use one of {', '.join(allowed)}")
        return text

    return parse


def _parse_ops(name: str, env: str, value: Any) -> tuple[str, ...] | None:
    """None means every op in the target table; names are checked against it."""
    if value is None:
        return None
    try:
        items = value.split(",") if isinstance(value, str) else [str(op) for op in value]
    except TypeError:  # not iterable
        raise ConfigError(
            f"{env}={value!r} (setting {name!r}) is not a list of ops: allowed are 'all' or a comma-separated "
            f"list of {', '.join(TARGET_NAMES)}"
        ) from None
    ops = tuple(op.strip() for op in items if op.strip())
    if not ops or ops == ("all",):
        return None
    unknown = [op for op in ops if op not in TARGET_NAMES]
    if unknown:
        raise ConfigError(
            f"{env}={value!r} (setting {name!r}) names unknown op(s) {', '.join(unknown)}: "
            f"allowed are 'all' or a comma-separated list of {', '.join(TARGET_NAMES)}"
        )
    return ops


def _parse_number(kind: type, what: str) -> Callable[[str, str, Any], Any]:
    """A parser for a number >= 0 of type ``kind`` (0 means off / no limit)."""

    def parse(name: str, env: str, value: Any):
        try:
            number = kind(value)
        except (TypeError, ValueError):
            number = -1
        if not number >= 0:
            raise ConfigError(f"{env}={value!r} (setting {name!r}) must be {what} >= 0 (0: off / no limit)")
        return number

    return parse


_parse_seconds = _parse_number(float, "a number of seconds")
_parse_count = _parse_number(int, "a whole number")


TEMPLATE_FIELDS = ("run", "rank", "pid")


def template_error(template: str) -> str:
    """What is wrong with a path template ('' when nothing): only ``{run}``, ``{rank}`` and ``{pid}``
    may appear, bare (no index, attribute, conversion or format spec); ``{{`` and ``}}`` are literal."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # an unmatched brace
        return f"only the fields {{run}}, {{rank}} and {{pid}} may appear ({exc})"
    for name, conv, spec in fields:
        if name not in TEMPLATE_FIELDS or conv or spec:
            shown = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            return f"only the fields {{run}}, {{rank}} and {{pid}} may appear, as written here (not {shown})"
    return ""


def _parse_output(name: str, env: str, value: Any) -> str:
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "0", "none", "off"):
        return ""
    if not text.endswith((".csv", ".parquet")):
        raise ConfigError(
            f"{env}={value!r} (setting {name!r}) must end in .csv or .parquet, or be 'none' to write nothing at exit"
        )
    problem = template_error(text)
    if problem:
        raise ConfigError(f"{env}={value!r} (setting {name!r}): {problem}")
    return text


def _needs_metrics_extra(env: str, value: Any) -> None:
    try:
        import prometheus_client  # noqa: F401 - only asked when a metrics setting is given
    except ImportError:
        raise ConfigError(
            f"{env}={value!r} needs the prometheus-client package: pip install 'commpatch[metrics]'"
        ) from None


def _parse_metrics_port(name: str, env: str, value: Any) -> tuple[str, int] | None:
    """'' / 0 / off: no server; PORT or HOST:PORT (each rank serves on PORT + its LOCAL_RANK)."""
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "0", "none", "off"):
        return None
    host, sep, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536 or (sep and not host):
        raise ConfigError(
            f"{env}={value!r} (setting {name!r}) must be a port 1-65535 or HOST:PORT (each rank serves "
            "on the port plus its LOCAL_RANK), or 0 for none"
        )
    _needs_metrics_extra(env, value)
    return host.strip("[]") if sep else "0.0.0.0", int(port)


def _parse_metrics_file(name: str, env: str, value: Any) -> str:
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "0", "none", "off"):
        return ""
    if not text.endswith(".prom"):
        raise ConfigError(
            f"{env}={value!r} (setting {name!r}) must end in .prom (node-exporter's textfile collector "
            "reads only those), or be 'none'"
        )
    problem = template_error(text)
    if problem:
        raise ConfigError(f"{env}={value!r} (setting {name!r}): {problem}")
    _needs_metrics_extra(env, value)
    return text


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: Any
    parse: Callable[[str, str, Any], Any]
    help: str
    monitoring: bool = False  # a bad value is a warning (to resolve's warn) and the setting off


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "active",
        "COMMPATCH",
        False,
        _parse_bool,
        "Instrument every Python process started with this set (via the installed .pth hook or `commpatch run`).",
    ),
    Setting(
        "output",
        "COMMPATCH_OUTPUT",
        "commpatch_logs/{run}/rank{rank}.csv",
        _parse_output,
        "Per-rank files: the binary log (same name, .cplog) is written from the first row on, the .csv or "
        ".parquet at a clean exit; {run} (one name per job and restart attempt, agreed by the ranks), {rank} and "
        "{pid} expand; an existing file is never replaced; 'none' keeps the rows in memory only.",
    ),
    Setting(
        "ops", "COMMPATCH_OPS", None, _parse_ops, "Comma-separated torch.distributed function names to wrap, or 'all'."
    ),
    Setting(
        "timing",
        "COMMPATCH_TIMING",
        "auto",
        _parse_choice("auto", "host"),
        "auto: device events for tensors on an accelerator, future callbacks for async CPU calls, NCCL's own timing when enabled; host: wall time of the call only.",
    ),
    Setting(
        "watchdog",
        "COMMPATCH_WATCHDOG",
        0.0,
        _parse_seconds,
        "Seconds a collective may stay in flight before its pending calls, their stacks and the last completed rows are dumped to stderr and hang_rank{rank}.txt beside the output (0: off). The job is not killed.",
    ),
    Setting(
        "max_rows",
        "COMMPATCH_MAX_ROWS",
        0,
        _parse_count,
        "With output 'none': rows kept in memory (0: no limit); beyond it the oldest are dropped and counted. "
        "With an output file: rows waiting for the disk (a slow, full or unwritable one) are bounded by it, "
        "or by 262144 (~15 MB) if that is more; beyond it the oldest waiting rows are dropped, counted and noted "
        "in the log: the training thread never waits for the disk.",
    ),
    Setting(
        "strict",
        "COMMPATCH_STRICT",
        False,
        _parse_bool,
        "1: enable() refuses an output that cannot be written (ConfigError; with COMMPATCH=1 the process exits "
        "with status 2 before the job starts). 0: a warning, and the rows are kept in memory (bounded as "
        "COMMPATCH_MAX_ROWS says) while the file is retried every second.",
    ),
    Setting("summary", "COMMPATCH_SUMMARY", False, _parse_bool, "Print a per-op summary table to stderr at exit."),
    Setting(
        "modules",
        "COMMPATCH_MODULES",
        True,
        _parse_bool,
        "Attribute each call to the nn.Module and phase (forward/backward/optimizer) that issued it (a wrapper of nn.Module._call_impl: ~0.5 us per module call).",
    ),
    Setting(
        "ddp_packing",
        "COMMPATCH_DDP_PACKING",
        True,
        _parse_bool,
        "Time DDP's packing of gradients into its buckets on CPU models (ddp_pack_us, counted in the shares): two hooks per parameter on its gradient accumulator, ~1.6-2.1 us per parameter per step. 0: not timed, and not in the shares.",
    ),
    Setting(
        "metrics_port",
        "COMMPATCH_METRICS_PORT",
        "0",
        _parse_metrics_port,
        "Serve live Prometheus metrics over HTTP on PORT (or HOST:PORT; all interfaces by default) plus the "
        "process's LOCAL_RANK, computed by the flusher thread, off the training thread (docs/live.md). "
        "Needs pip install 'commpatch[metrics]'. 0: none. A bad value is a warning: the job runs without metrics.",
        monitoring=True,
    ),
    Setting(
        "metrics_file",
        "COMMPATCH_METRICS_FILE",
        "none",
        _parse_metrics_file,
        "Write the same metrics every 2 s (and at exit) to this .prom file per rank ({rank}, {pid} expand; {run} too) for "
        "node-exporter's textfile collector; replaced whole each time. Needs pip install 'commpatch[metrics]'. "
        "'none': no file. A bad value is a warning: the job runs without the file.",
        monitoring=True,
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}


def resolve(
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Settings after precedence: overrides > environment > defaults; every value parsed. With
    ``warn``, a monitoring setting's bad value is said there (one line) and the setting left off."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}: allowed are {', '.join(BY_NAME)}")
    out = {}
    for s in SETTINGS:
        if s.name in overrides:
            raw, where = overrides[s.name], f"enable({s.name}=...)"
        elif s.env in environ:
            raw, where = environ[s.env], s.env
        else:
            out[s.name] = s.parse(s.name, s.env, s.default) if s.default is not None else None
            continue
        try:
            out[s.name] = s.parse(s.name, where, raw)
        except ConfigError as exc:
            if not (s.monitoring and warn):
                raise
            warn(f"commpatch: {exc}; the job runs without it")
            out[s.name] = s.parse(s.name, s.env, s.default)
    return out


def env_active(environ: dict[str, str] | None = None) -> bool:
    """Whether COMMPATCH asks for activation; raises ConfigError on a bad value."""
    environ = os.environ if environ is None else environ
    s = BY_NAME["active"]
    return s.parse(s.name, s.env, environ.get(s.env, ""))


def check(env: str, environ: dict[str, str] | None = None) -> str:
    """What is wrong with one environment variable's value ('' when it is fine or unset)."""
    environ = os.environ if environ is None else environ
    for s in SETTINGS:
        if s.env == env and env in environ:
            try:
                s.parse(s.name, s.env, environ[env])
            except ConfigError as exc:
                return str(exc)
    return ""


def describe(environ: dict[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """(env var, current value or None when unset, default as written in the environment, help)
    for `commpatch env` and the README."""
    environ = os.environ if environ is None else environ
    return [(s.env, environ.get(s.env), _as_env(s.default), s.help) for s in SETTINGS]


def _as_env(value) -> str:
    """A default as it would be written in the environment (the README's notation): False -> '0',
    True -> '1', None (every op) -> 'all', 0.0 -> '0'."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return "all"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
