"""Live Prometheus metrics of a rank (optional extra ``metrics``: prometheus-client).

``COMMPATCH_METRICS_PORT`` serves them over HTTP (each rank on the port plus its ``LOCAL_RANK``),
``COMMPATCH_METRICS_FILE`` writes them to a text file per rank for node-exporter's textfile
collector. Computed off the hot path: the flusher thread hands the frames it writes to
``Exporter.update`` (every ``record.sinks.FLUSH_S``), which decodes them (``data.follow``) and adds
the rows whose duration is known to numpy counters; the per-step figures come from
``analysis.steps.per_step`` over the last steps, at most once a second; the HTTP server's thread
reads the counters when scraped. The calls in flight are read from the log's ``pending`` calls
at scrape time. Label values are bounded: at most ``MAX_GROUPS`` group names and ``MAX_DTYPES``
dtypes per rank keep their name, later ones are counted as "other".

The HTTP server is commpatch's own (``_Server``), not prometheus-client's thread per connection:
it answers ``GET /metrics`` only (404 elsewhere), one request per connection, serves at most
``MAX_CONNECTIONS`` connections at once (more are closed as they come: no thread for them) and
gives each ``REQUEST_S`` seconds; it never prints into the job's stderr.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import numpy as np

from .analysis import REPORT_COLUMNS
from .analysis.live import counted_steps
from .analysis.steps import per_step
from .data.follow import Follower
from .io.paths import rank_path
from .io.writer import write_bytes

PREFIX = "commpatch_"
LABELS = ("collective", "group", "phase", "dtype")
# 'run', not 'job': Prometheus sets 'job' itself; run: the launcher's id of the job (TORCHELASTIC_RUN_ID,
# SLURM_JOB_ID), else the log's run directory; run_dir: the log's run directory (its name), '' without a file
WHO = ("rank", "host", "run", "run_dir")
MAX_GROUPS = 16
MAX_DTYPES = 8
OTHER = "other"
DURATION_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
BUSBW_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
STEP_BUCKETS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
HORIZON_S = 10.0  # an async call's row waits this long for its duration, then counts as unmeasured
STEPS_EVERY_S = 2.0  # per-step figures and the text file, at most this often (per_step: ~50 ms a pass)
KEEP_STEPS = 16  # steps of rows kept for the per-step figures
MAX_CONNECTIONS = 8  # connections served at once (a scrape is one short request); more are closed at once
REQUEST_S = 5.0  # a connection has this long to send its request (and each write of the answer)
COUNTED = ("seq", "collective", "group", "phase", "dtype", "bytes", "duration_us", "own_us", "busbw_gbps")

# name -> (type, help): every metric this module exposes (the Grafana dashboard's test reads it)
METRICS = {
    "calls": ("counter", "Collective calls recorded"),
    "bytes": ("counter", "Bytes of the messages (nccl-tests' S: all_gather the full output, ...)"),
    "unmeasured_calls": ("counter", "Calls whose duration is unknown (never timed, or not within 10 s)"),
    "duration_seconds": ("histogram", "Duration of each measured call (issue to completion)"),
    "own_seconds": ("histogram", "Own time of each measured call (not queued behind earlier calls of its group)"),
    "busbw_gbps": ("histogram", "Bus bandwidth of each measured call, GB/s (nccl-tests' definition)"),
    "step": ("gauge", "The step of the rank's latest call"),
    "step_seconds": ("gauge", "Time of the rank's last complete step"),
    "step_time_seconds": ("histogram", "Time of each complete step"),
    "comm_share": ("gauge", "Share of the last complete step with communication under way (NaN: unknown)"),
    "exposed_share": (
        "gauge",
        "Share of the last complete step the training thread spent on communication (NaN: unknown)",
    ),
    "inflight_calls": ("gauge", "Calls in flight now (async calls; every call with COMMPATCH_WATCHDOG set)"),
    "inflight_oldest_seconds": ("gauge", "Age of the oldest call in flight: the hang alarm (0: none in flight)"),
    "uncounted_rows": ("counter", "Rows the metrics could not count (their window overflowed)"),
}


class _Histograms:
    """Cumulative histogram buckets per label key, numpy arrays: observing a batch is a handful of
    vectorised operations, not a Python call per value."""

    def __init__(self, bounds) -> None:
        self.bounds = np.asarray(bounds, np.float64)
        self.by_key: dict[tuple, list] = {}  # key -> [bucket counts (len(bounds) + 1), sum]

    def observe(self, keys: list, inverse, values) -> None:
        ok = ~np.isnan(values)
        slot = np.searchsorted(self.bounds, values[ok], side="left")  # le semantics: value <= bound
        n = len(self.bounds) + 1
        counts = np.bincount(inverse[ok] * n + slot, minlength=len(keys) * n).reshape(len(keys), n)
        sums = np.bincount(inverse[ok], weights=values[ok], minlength=len(keys))
        for i, key in enumerate(keys):
            if counts[i].any():
                entry = self.by_key.setdefault(key, [np.zeros(n, np.int64), 0.0])
                entry[0] += counts[i]
                entry[1] += float(sums[i])

    def families(self, family_type, name: str, help_text: str, labels: tuple):
        family = family_type(name, help_text, labels=labels)
        for key, (counts, total) in list(self.by_key.items()):
            cumulative = np.cumsum(counts)
            buckets = [(_le(b), float(c)) for b, c in zip(self.bounds, cumulative[:-1])] + [
                ("+Inf", float(cumulative[-1]))
            ]
            family.add_metric(list(key), buckets, total)
        return family


def _le(bound: float) -> str:
    return repr(float(bound))


class Exporter:
    """The metrics of one rank: fed by the flusher (``update``), read by the HTTP server and the
    text file (``collect``: a prometheus-client custom collector)."""

    def __init__(self, log, port=None, file_template: str = "", warn=None) -> None:
        import pandas  # noqa: F401 - the per-step figures need it: imported now, not by the flusher mid-job
        import prometheus_client  # noqa: F401 - checked by config already; a clear error if not

        self.log = log
        self.warn = warn or (lambda message: None)
        self.follower = Follower(keep_steps=KEEP_STEPS, with_magic=False, settling=True)
        self.lock = threading.Lock()  # the counters (updated here, read by the server)
        self.update_lock = threading.Lock()  # one update at a time (the flusher, the exit)
        self.host = socket.gethostname().split(".")[0]
        self.counts: dict[tuple, list] = {}  # key -> [calls, bytes, unmeasured]
        self.hist = {
            "duration_seconds": _Histograms(DURATION_BUCKETS),
            "own_seconds": _Histograms(DURATION_BUCKETS),
            "busbw_gbps": _Histograms(BUSBW_BUCKETS),
        }
        self.step_hist = _Histograms(STEP_BUCKETS)
        self.step_gauges: dict[str, float] = {}
        self.last_step_seen = None
        self.names = {"group": {}, "dtype": {}}  # bounded label values
        self.who: tuple = ()
        self.file_template = file_template
        self.last_steps = 0.0
        self.server = None
        self.address = None
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        if port is not None:
            self.serve(port)

    # ---- serving -----------------------------------------------------------------------------
    def serve(self, port) -> None:
        host, base = port
        local = os.environ.get("LOCAL_RANK", "0")
        number = base + (int(local) if local.isdigit() else 0)
        try:
            server = _Server(host, number, self.registry)
        except (OSError, OverflowError) as exc:
            self.warn(
                f"commpatch: metrics not served on {host}:{number} (COMMPATCH_METRICS_PORT {base} + local rank "
                f"{local}): {getattr(exc, 'strerror', None) or exc}; the job runs on"
            )
            return
        threading.Thread(target=server.serve_forever, args=(0.5,), name="commpatch-metrics", daemon=True).start()
        self.server, self.address = server, (host, server.server_address[1])

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # ---- fed by the flusher ------------------------------------------------------------------
    def update(self, final: bool = False) -> None:
        """Decode the frames the flusher wrote since the last call and count what settled; every
        STEPS_EVERY_S (and when ``final``) the per-step figures and the text file."""
        with self.update_lock:
            self._update(final)

    def _update(self, final: bool) -> None:
        frames = self.log.take_observed()
        follower = self.follower
        for data in frames:
            follower.feed(data)
        now = time.time_ns()
        cols = follower.take_settled(now, int(HORIZON_S * 1e9), final=final, names=COUNTED)
        with self.lock:
            if follower.parsed.header and not self.who:
                run_dir = self._run_dir()
                self.who = (str(follower.parsed.header.get("rank", -1)), self.host, self._run(run_dir), run_dir)
            if cols is not None and self.who:
                self._count(cols)
        if final or time.monotonic() - self.last_steps >= STEPS_EVERY_S:
            self.last_steps = time.monotonic()
            self._steps()
            if self.file_template and self.who:
                self.write_file()

    def _run(self, run_dir: str) -> str:
        for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
            if os.environ.get(name):
                return os.environ[name]
        return run_dir

    def _run_dir(self) -> str:
        path = getattr(self.log.sink, "path", None)
        return os.path.basename(os.path.dirname(path)) if path else ""

    def _label(self, kind: str, name: str, most: int) -> str:
        known = self.names[kind]
        if name not in known:
            known[name] = name if len(known) < most else OTHER
        return known[name]

    def _count(self, cols: dict) -> None:
        n = len(cols["seq"])
        if not n:
            return
        # one integer key per row from the label columns' codes (-1, missing, as the last value)
        key, names = np.zeros(n, np.int64), []
        for name in LABELS:
            c = cols[name]
            values = [
                self._label(name, v, MAX_GROUPS if name == "group" else MAX_DTYPES) if name in self.names else v
                for v in c.categories
            ] + ["?"]
            codes = np.where(c.codes < 0, len(values) - 1, c.codes).astype(np.int64)
            key = key * len(values) + codes
            names.append(values)
        uniq, inverse = np.unique(key, return_inverse=True)
        keys = []
        for k in uniq.tolist():
            parts = []
            for values in reversed(names):
                k, i = divmod(k, len(values))
                parts.append(values[i])
            keys.append(tuple(reversed(parts)) + self.who)
        duration = cols["duration_us"] / 1e6
        calls = np.bincount(inverse, minlength=len(keys))
        nbytes = np.bincount(inverse, weights=cols["bytes"].astype(np.float64), minlength=len(keys))
        unmeasured = np.bincount(inverse, weights=np.isnan(duration).astype(np.float64), minlength=len(keys))
        for i, key in enumerate(keys):
            entry = self.counts.setdefault(key, [0, 0, 0])
            entry[0] += int(calls[i])
            entry[1] += int(nbytes[i])
            entry[2] += int(unmeasured[i])
        # as analysis.summaries.own_durations: the own time, never more than the duration; the
        # duration where the own time is unknown
        own = (
            np.where(np.isnan(cols["own_us"]), cols["duration_us"], np.minimum(cols["own_us"], cols["duration_us"]))
            / 1e6
        )
        self.hist["duration_seconds"].observe(keys, inverse, duration)
        self.hist["own_seconds"].observe(keys, inverse, own)
        self.hist["busbw_gbps"].observe(keys, inverse, cols["busbw_gbps"])

    def _steps(self) -> None:
        follower = self.follower
        if not len(follower.window) or not self.who:
            return
        df = follower.dataframe(names=REPORT_COLUMNS)
        if not counted_steps(df):  # steps found from a pattern would be the window's: left out
            return
        table = per_step(df)
        known = table[table["step_us"].notna()]
        if self.last_step_seen is not None:
            fresh = known[known["step"] > self.last_step_seen]
        else:
            fresh = known
        with self.lock:
            if len(fresh):
                self.step_hist.observe(
                    [self.who], np.zeros(len(fresh), np.int64), fresh["step_us"].to_numpy(np.float64) / 1e6
                )
                self.last_step_seen = int(fresh["step"].max())
            self.step_gauges["step"] = float(table["step"].max())
            if len(known):
                last = known.iloc[-1]
                self.step_gauges.update(
                    step_seconds=float(last["step_us"]) / 1e6,
                    comm_share=float(last["comm_share"]),
                    exposed_share=float(last["exposed_share"]),
                )

    def write_file(self) -> str:
        """The metrics in Prometheus' text format to this rank's file (replaced whole: readers never
        see half a file; never written through a link)."""
        from prometheus_client import generate_latest

        path = rank_path(self.file_template, rank=int(self.who[0]), run=self.who[3] or self.who[2])
        try:
            return write_bytes(generate_latest(self.registry), path, exclusive=False)
        except OSError as exc:
            self.warn(f"commpatch: cannot write the metrics file {path}: {exc.strerror or exc}")
            return ""

    # ---- read by the HTTP server and the text file --------------------------------------------
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        labels = LABELS + WHO
        with self.lock:
            counters = [
                CounterMetricFamily(PREFIX + name, METRICS[name][1], labels=labels)
                for name in ("calls", "bytes", "unmeasured_calls")
            ]
            for key, values in self.counts.items():
                for family, value in zip(counters, values):
                    family.add_metric(list(key), float(value))
            out = counters
            out += [
                h.families(HistogramMetricFamily, PREFIX + name, METRICS[name][1], labels)
                for name, h in self.hist.items()
            ]
            if self.who:
                out.append(
                    self.step_hist.families(
                        HistogramMetricFamily, PREFIX + "step_time_seconds", METRICS["step_time_seconds"][1], WHO
                    )
                )
                for name, value in self.step_gauges.items():
                    gauge = GaugeMetricFamily(PREFIX + name, METRICS[name][1], labels=WHO)
                    gauge.add_metric(list(self.who), value)
                    out.append(gauge)
                calls, oldest = in_flight(self.log)
                for name, value in (("inflight_calls", calls), ("inflight_oldest_seconds", oldest)):
                    gauge = GaugeMetricFamily(PREFIX + name, METRICS[name][1], labels=WHO)
                    gauge.add_metric(list(self.who), value)
                    out.append(gauge)
                lost = CounterMetricFamily(PREFIX + "uncounted_rows", METRICS["uncounted_rows"][1], labels=WHO)
                lost.add_metric(list(self.who), float(self.follower.dropped_unsettled))
                out.append(lost)
        return out


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics`` (HEAD too): the registry in the format the scraper accepts; anything else
    a 404. HTTP/1.0: one request per connection."""

    timeout = REQUEST_S
    server_version = "commpatch"
    sys_version = ""

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/metrics":
            self._answer(404, b"commpatch serves /metrics only\n", "text/plain; charset=utf-8")
            return
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        self._answer(200, encoder(self.server.registry), content_type)  # type: ignore[attr-defined]

    do_HEAD = do_GET

    def _answer(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """Nothing into the job's stderr."""


class _Server(socketserver.TCPServer):
    """The metrics endpoint: a thread per connection, at most ``MAX_CONNECTIONS`` of them; a
    connection beyond that is closed as it is accepted (an idle or slow client holds its slot
    ``REQUEST_S`` seconds at most)."""

    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, registry) -> None:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        self.registry = registry
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address[:2], _Handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed, no thread started
            return
        try:
            threading.Thread(
                target=self._serve, args=(request, client_address), name="commpatch-metrics-conn", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: this scrape is lost, the job goes on
            self.shutdown_request(request)
            self.slots.release()

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client that went away: nothing to say in the job's stderr
            pass
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        """Nothing into the job's stderr (the base class prints a traceback)."""


def in_flight(log) -> tuple[int, float]:
    """(calls in flight, age in seconds of the oldest) from the log's pending calls (a small
    function of its own: the hang issue's record of every call at issue will feed it)."""
    for _ in range(3):
        try:
            starts = [p[4] for p in list(log.pending.values())]
            break
        except RuntimeError:  # changed size while read: read again
            continue
    else:
        return 0, float("nan")
    if not starts:
        return 0, 0.0
    return len(starts), (time.perf_counter_ns() - min(starts)) / 1e9
