"""Hostile and broken input for the surfaces people look at (issue 33): the HTML page and
``commpatch watch``. Names carrying markup, script, escapes, bidi controls and 200,000 characters,
in every name a log holds (op, group, tag, module) and in the run directory's name; rank logs
replaced or truncated while they are followed; logs whose records point far away from any row.
Each case runs bounded in time and memory (a child process under an address-space limit, its
peak resident memory read back) and asserts on what came out, not only that nothing crashed."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from tests.test_watch import _watch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = "n" * 200_000
# what a name may hold to break a page or a terminal; the markers name what would run
NAMES = {
    "comment_script": "<!--<script>",
    "close_script": "</script><script>window.__injected='close';document.title='injected'</script>",
    "script": "<script>window.__injected='script'</script>",
    "img_onerror": "<img src=x onerror=\"window.__injected='img'\">",
    "cdata_comment": "]]><!-- -->--!><!--",
    "line_separators": "a\u2028b\u2029c",
    "bidi": "\u202eevil\u202c \u2066iso\u2069 \u200f",
    "entities": "&lt;&amp;&#60;&#x3c;",
    "escaped": "\\u003c/script\\u003e \\x3c \\\\",
    "quotes": "'\"`${1}</",
    "terminal": "\x1b[2J\x1b]0;title\x07\x9b31m",
    "long": LONG,
}


# runs the Python arguments after it (-m MODULE ... or -c CODE ...), then says its peak resident
# memory: VmHWM is this process's own (ru_maxrss would count the forking parent's too)
_PEAK = """
import runpy, sys
args = sys.argv[1:]
try:
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
finally:
    hwm = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))
    sys.stderr.write(f"\\ncommpatch-test-peak-kb {hwm}\\n")
"""


def bounded(args, timeout_s: float, mem_gb: float = 4.0):
    """``python ARGS`` in a child process under an address-space limit of ``mem_gb``, killed after
    ``timeout_s``: (exit status, stdout, stderr, peak resident MB)."""
    limit = int(mem_gb * (1 << 30))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=timeout_s,
    )
    err, _, peak = done.stderr.rpartition("\ncommpatch-test-peak-kb ")
    return done.returncode, done.stdout, err, int(peak) / 1024 if peak.strip().isdigit() else float("inf")


# what would have run, the title, and the texts of the skew table's op column as the page shows them
PROBE = """() => {
  const t = document.querySelector("table[data-table='skew']");
  const i = [...t.querySelectorAll("th")].map((h) => h.textContent).indexOf("op");
  return [window.__injected ?? null, document.title,
          [...t.querySelectorAll("tbody tr")].map((r) => r.children[i].textContent)];
}"""


def named_run(directory: str, name: str) -> str:
    """A 2-rank CSV run whose op, group, tag and module names all hold ``name``."""
    import pandas as pd

    from commpatch.testing import write_rank_files

    write_rank_files(directory, 2, 6)
    for f in sorted(os.listdir(directory)):
        path = os.path.join(directory, f)
        df = pd.read_csv(path, keep_default_na=False)
        df["op"] = df["op"] + name
        df["group"] = df["group"].astype(str) + name
        df["tag"] = name
        df["module"] = name
        df.to_csv(path, index=False)
    return directory


# ---- the HTML page ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(NAMES))
def test_html_page_with_hostile_names_draws_and_runs_nothing_of_them(case, tmp_path):
    """The page of a run whose names (and directory) hold the payload: drawn in headless Chromium
    (tables and plots), nothing of the payload run, and the names shown as text, whole."""
    from tests.test_html_report import check_page, load

    name = NAMES[case]
    folder = "run" + ("<!--<script>" if case != "long" else "") + name.replace("/", "_")[:60]
    run = named_run(str(tmp_path / folder), name)
    page = str(tmp_path / "r.html")
    code, _, err, peak = bounded(["-m", "commpatch", "report", run, "--html", page, "--no-progress"], timeout_s=240)
    assert code == 0, err[-2000:]
    assert peak < 1500, peak
    out = load(page, probe=PROBE, timeout_ms=30_000)
    check_page(out, ["bandwidth", "steps", "heatmap", "timeline"])
    text = open(page, encoding="utf-8").read()
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S).group(1)
    assert "<" not in block and ">" not in block and "&" not in block
    data = json.loads(block)
    assert any(name in text for text in _strings(data))  # the page does hold the payload, as it is
    assert {"table-summary", "table-steps", "table-ranks", "table-skew"} <= set(out["sections"])
    injected, title, ops = out["probe"]
    assert injected is None and title == data["title"]
    # the names are on the page as text, whole (textContent: never parsed as markup)
    skew = data["tables"]["skew"]
    assert ops == [row[skew["columns"].index("op")] for row in skew["rows"]] and ops
    assert all(op.endswith(name) for op in ops), ops[:2]


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


# ---- commpatch watch: records pointing away from every row --------------------------------------
def late_flood(path: str, frames: int, pairs: int = 1 << 16, first_seq: int = 10**12) -> str:
    """A rank log written as commpatch writes it (``write_binary_run``: 40 steps of rows), then
    ``frames`` LATE and OWN frames of ``pairs`` (seq, ns) pairs each, for seqs far above any row
    (a damaged or hostile file: no row will ever claim them)."""
    import numpy as np

    from commpatch.data import logfile
    from commpatch.testing import write_binary_run

    write_binary_run(os.path.dirname(path), 2, 400, straggler=None, mismatch=None)
    with open(path, "ab") as f:
        for i in range(frames):
            seq = np.arange(first_seq + i * pairs, first_seq + (i + 1) * pairs, dtype="<i8")
            payload = np.stack((seq, np.full(pairs, 1000, "<i8")), axis=1).tobytes()
            f.write(logfile.frame(logfile.LATE if i % 2 == 0 else logfile.OWN, payload))
    return path


def test_follower_holds_no_more_pairs_than_its_window_whatever_the_file_holds(tmp_path):
    """2M LATE / OWN pairs for rows that never come: the follower keeps the window's pairs and at
    most ``max_rows`` waiting ones, and the rows it shows keep their durations."""
    from commpatch.data.follow import Follower
    from commpatch.data.frame import parsed_frame

    path = late_flood(str(tmp_path / "run" / "rank0.cplog"), frames=32)
    data = open(path, "rb").read()
    rows_end = len(data) - 32 * (5 + 16 * (1 << 16))
    follower = Follower(max_rows=1000, keep_steps=4)
    most_held = 0
    for i in range(0, len(data), 1 << 20):
        follower.feed(data[i : i + (1 << 20)])
        held = len(follower.late) + len(follower.own)
        most_held = max(most_held, held)
        assert held <= 2 * (len(follower.window) + follower.max_rows), (i, held)
        assert len(follower.pending) <= 16  # no frame waits whole: its pairs are taken as they come
    assert follower.bytes_read == len(data) and follower.skipped_bytes == 0
    assert most_held <= 4000
    # the window's rows with their durations, as the whole file's reader gives them
    whole = parsed_frame(data[:rows_end])
    live = follower.dataframe().sort_values("seq")
    last = whole[whole["seq"].isin(live["seq"])].sort_values("seq")
    assert len(live) and live["duration_us"].tolist() == last["duration_us"].tolist()


_INFLIGHT = dict(k="inflight", below=0, op=0, gid=0, peer=-1, numel=1, bytes=4, start=1, seen=1, thread="t", stack=[])
NOTES = {  # a registry record per call, of each kind a log holds, for seq ``i``
    "syncs": lambda i: dict(k="sync", seq=i, end=1),
    "packs": lambda i: dict(k="pack", seq=i, ns=1, alone=1),
    "buckets": lambda i: dict(k="bucket", lo=i, hi=i + 1, index=0, params=1),
    "clock": lambda i: dict(k="clock", seq=i, offset=0),
    "step_sources": lambda i: dict(k="step_source", seq=i, source=1),
    "lost": lambda i: dict(k="lost", rows=1, first_seq=i, last_seq=i, why="x"),
    "rank0_offsets": lambda i: dict(k="rank0_offset", at=i, lo=0, hi=1),
    "inflight": lambda i: dict(_INFLIGHT, id=i, seq=i),
    "landed": lambda i: dict(k="landed", id=i, ns=1),
}


def test_follower_holds_a_bounded_number_of_registry_records_whatever_the_file_holds(tmp_path):
    """After the rows, 20,000 records of each per-call kind (DDP syncs, packs, buckets, clock
    offsets, step sources, rows lost, calls in flight...), for seqs beyond any row: the follower
    keeps at most twice its window of each, and the rows it shows are the same."""
    from commpatch.data import logfile
    from commpatch.data.follow import Follower
    from commpatch.testing import write_binary_run

    write_binary_run(str(tmp_path / "run"), 2, 400, straggler=None, mismatch=None)
    data = (tmp_path / "run" / "rank0.cplog").read_bytes()
    flood = b"".join(
        logfile.frame(logfile.META, json.dumps(make(10**9 + i)).encode())
        for i in range(20_000)
        for make in NOTES.values()
    )
    follower = Follower(max_rows=1000, keep_steps=4)
    follower.feed(data)
    window = follower.window.copy()
    for i in range(0, len(flood), 1 << 20):
        follower.feed(flood[i : i + (1 << 20)])
        for name in NOTES:
            held = len(getattr(follower.parsed, name))
            assert held <= 2 * follower.max_rows, (name, held)
    assert follower.bad_records == 0 and (follower.window == window).all()
    assert follower.dataframe()["duration_us"].notna().all()


def test_watch_memory_is_bounded_by_its_window_on_a_flood_of_late_frames(tmp_path):
    """A 128 MiB log of LATE / OWN frames (8M pairs, seqs far above any row) read by ``watch``'s
    follower in a child process: its resident memory grows by far less than the file (before the
    fix every pair was kept: ~1 GB)."""
    path = late_flood(str(tmp_path / "run" / "rank0.cplog"), frames=128)
    size = os.path.getsize(path)
    assert size > 128 << 20
    code = (
        "import json, sys\n"
        "import numpy\n"
        "from commpatch.io.follow import FileFollower\n"
        "from commpatch.watch import WINDOW_ROWS, WINDOW_STEPS\n"
        "before = next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM'))\n"
        "f = FileFollower(sys.argv[1], keep_steps=WINDOW_STEPS, max_rows=WINDOW_ROWS)\n"
        "while f.poll():\n"
        "    pass\n"
        "live = f.follower\n"
        "print(json.dumps(dict(before_mb=before / 1024, read=f.offset, rows=len(live.window),\n"
        "                      pairs=len(live.late) + len(live.own), error=f.error)))\n"
    )
    status, out, err, peak = bounded(["-c", code, path], timeout_s=300, mem_gb=3)
    assert status == 0, err[-2000:]
    got = json.loads(out.splitlines()[-1])
    assert got["read"] == size and got["error"] == "" and got["rows"] > 0
    assert got["pairs"] <= 2 * (1 << 16)
    assert peak - got["before_mb"] < 150, (peak, got)  # the file: 128 MiB; the window: a few MB


def test_metrics_exporter_counts_no_more_pairs_than_its_window(tmp_path):
    """The in-process metrics exporter decodes the frames the flusher writes with the same
    follower: a flood of LATE frames keeps its memory bounded too."""
    pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus-client) is not installed")
    import types

    from commpatch.data import logfile
    from commpatch.metrics import Exporter

    path = late_flood(str(tmp_path / "run" / "rank0.cplog"), frames=16)
    data = open(path, "rb").read()[len(logfile.MAGIC) :]  # the flusher's frames come without the file's magic
    pieces = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    exporter = Exporter(
        types.SimpleNamespace(pending={}, sink=None, take_observed=lambda: pieces[:1] and [pieces.pop(0)])
    )
    while pieces:
        exporter.update()
        live = exporter.follower
        assert len(live.late) + len(live.own) <= 2 * (len(live.window) + live.max_rows)
    exporter.update(final=True)
    assert sum(v[0] for v in exporter.counts.values()) == exporter.follower.rows_seen > 0


# ---- commpatch watch: a log replaced or rewritten while followed ----------------------------------
@pytest.fixture(scope="module")
def two_logs(tmp_path_factory):
    """Two different rank logs (of a 2-rank and of a 4-rank run: their first bytes differ), as
    commpatch writes them, the second longer."""
    from commpatch.testing import write_binary_run

    out = tmp_path_factory.mktemp("two")
    write_binary_run(str(out / "a"), 2, 400, straggler=None, mismatch=None)
    write_binary_run(str(out / "b"), 4, 1200, straggler=None, mismatch=None, seed=1)
    a, b = (open(out / d / "rank0.cplog", "rb").read() for d in ("a", "b"))
    assert a[:256] != b[:256] and len(b) > len(a)
    return a, b


def _follow(path):
    from commpatch.io.follow import FileFollower

    return FileFollower(str(path), max_rows=1 << 20, keep_steps=1 << 20)


def _rows_of(data):
    from commpatch.data.frame import parse_log

    return parse_log(data).rows


@pytest.mark.parametrize("how", ["replaced", "truncated", "rewritten"])
def test_file_follower_starts_over_on_a_log_replaced_or_rewritten(two_logs, tmp_path, how):
    """Half of log A is read; then the path holds log B: moved over it (a new inode), or A cut
    to nothing and B written (shorter than what was read), or B written over A in place (longer:
    only A's first bytes tell). The follower reads B from its start: its rows are B's, none of A's."""
    import numpy as np

    a, b = two_logs
    path = tmp_path / "rank0.cplog"
    path.write_bytes(a[: len(a) // 2])
    f = _follow(path)
    assert f.poll() == len(a) // 2 and len(f.follower.window)
    if how == "replaced":
        (tmp_path / "new").write_bytes(b)
        os.replace(tmp_path / "new", path)
    elif how == "truncated":
        with open(path, "r+b") as out:
            out.truncate(0)
            out.write(b[:1000])  # shorter than what was read
    else:
        with open(path, "r+b") as out:
            out.write(b)  # in place: as long as before and longer
    f.poll()
    if how == "truncated":
        with open(path, "ab") as out:
            out.write(b[1000:])
        f.poll()
    assert f.restarts == 1 and f.restarted == {"replaced": "replaced by a new file"}.get(how, how)
    assert f.offset == len(b) and f.error == ""
    assert np.array_equal(f.follower.window, _rows_of(b))
    assert f.follower.parsed.header["world_size"] == 4
    f.poll()  # nothing changed since: no new start
    assert f.restarts == 1
    f.close()


def test_a_log_that_was_not_a_rank_log_is_read_once_replaced(two_logs, tmp_path):
    """A file that is no rank log stops its reading; replaced by a rank log, it is read."""
    path = tmp_path / "rank0.cplog"
    path.write_bytes(b"not a log at all\n" * 10)
    f = _follow(path)
    f.poll()
    assert "not a commpatch binary log" in f.error
    f.poll()
    assert f.restarts == 0  # the same file: not read again and again
    (tmp_path / "new").write_bytes(two_logs[0])
    os.replace(tmp_path / "new", path)
    f.poll()
    assert f.error == "" and f.restarts == 1 and len(f.follower.window) == len(_rows_of(two_logs[0]))
    f.close()


def _write_slowly(path, first, second, seconds, then):
    """Append ``first`` to ``path`` in pieces over ``seconds / 2``; then move a new empty file over
    it and append ``second`` the same way; at the end write ``then`` (the export at exit)."""
    import time

    for data in (first, second):
        if data is second:
            open(str(path) + ".new", "wb").close()
            os.replace(str(path) + ".new", path)
        with open(path, "ab") as out:
            step = -(-len(data) // 20)
            for at in range(0, len(data), step):
                out.write(data[at : at + step])
                out.flush()
                time.sleep(seconds / 40)
    open(then, "w").close()


def test_watch_follows_a_log_replaced_while_it_runs_until_the_job_ends(two_logs, tmp_path):
    """A rank log is replaced half-way by a new file that goes on growing (a restarted rank):
    ``watch --idle 3`` follows the new file until the export appears (before: it kept reading the
    old, deleted file and ended saying no log grew). In a pipe, it says what it follows."""
    import time

    run = tmp_path / "run"
    run.mkdir()
    path = run / "rank0.cplog"
    path.write_bytes(b"")
    watch = _watch(str(run), "--interval", "0.3", "--idle", "3")
    try:
        time.sleep(1.0)
        _write_slowly(path, two_logs[0], two_logs[1], 8.0, then=run / "rank0.csv")
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, err
    assert "Traceback" not in out + err
    assert "the job ended: every rank wrote its export at exit" in err, err
    assert f"{path}: replaced by a new file: read again from its start" in err
    assert "following 1 rank log(s)" in err
    table = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert table and table[-1].split("│")[1].strip() == "0", out


def test_watch_in_a_pipe_says_what_it_waits_for_while_it_waits(tmp_path):
    """Not a terminal: rich draws nothing until the end, so ``watch`` says in a line, at once,
    that it waits for rank logs, and where."""
    import selectors
    import time

    watch = _watch(str(tmp_path), "--interval", "0.2", "--idle", "60")
    try:
        sel = selectors.DefaultSelector()
        sel.register(watch.stderr, selectors.EVENT_READ)
        deadline, line = time.monotonic() + 60, ""
        while not line and time.monotonic() < deadline and watch.poll() is None:
            if sel.select(timeout=1.0):
                line = watch.stderr.readline()
        assert watch.poll() is None  # said while waiting, not at the end
        assert line.strip() == f"commpatch watch: waiting for rank logs (*.cplog) in {tmp_path} (for 60 s at most)"
    finally:
        watch.kill()
        watch.communicate()


# ---- commpatch watch: hostile names on the screen -------------------------------------------------
def hostile_log(path: str, name: str) -> None:
    """A rank log as commpatch writes it whose process groups are all named ``name`` and whose
    last call is an async all_reduce still in flight (no duration arrived)."""
    import json as _json

    import numpy as np

    from commpatch.data import logfile
    from commpatch.data.schema import F_ASYNC, T_SHIFT, TIMINGS, row_dtype
    from commpatch.testing import write_binary_run
    from tests.test_fuzz import _frames

    write_binary_run(os.path.dirname(path), 2, 400, straggler=None, mismatch=None)
    data = open(path, "rb").read()
    out = bytearray(logfile.MAGIC)
    frames = _frames(data)
    for i, (kind, lo, hi) in enumerate(frames):
        payload = data[lo + 5 : hi]
        if kind == logfile.META and _json.loads(payload).get("k") == "group":
            record = _json.loads(payload)
            record["name"] = name
            payload = _json.dumps(record).encode()
        elif kind == logfile.ROWS and i == max(j for j, f in enumerate(frames) if f[0] == logfile.ROWS):
            rows = np.frombuffer(payload, dtype=row_dtype(np)).copy()
            rows["flags"][-1] = F_ASYNC | (TIMINGS.index("future") << T_SHIFT)
            payload = rows.tobytes()
        out += logfile.frame(kind, payload)
    open(path, "wb").write(bytes(out))


@pytest.mark.parametrize("case", sorted(NAMES))
def test_watch_shows_hostile_names_as_printable_text(case, tmp_path):
    """A call in flight on a group named with markup, escapes, bidi controls or 200,000
    characters: the live view lists it with the name shown escaped and cut (as the text report
    does), and nothing a terminal acts on reaches it from the file."""
    import io

    from rich.console import Console

    from commpatch.io.follow import RunFollower
    from commpatch.render.live import screen
    from commpatch.render.people import _cut, terminal_safe
    from commpatch.watch import snapshot

    name = NAMES[case]
    run = tmp_path / ("run" + name.replace("/", "_")[:60])
    hostile_log(str(run / "rank0.cplog"), name)
    follower = RunFollower(str(run))
    follower.poll()
    assert follower.by_rank()[0].offset == os.path.getsize(run / "rank0.cplog")
    snap = snapshot(follower, now_ns=1 << 62, stuck_s=1.0)
    follower.close()
    assert snap["stuck"]["group"].tolist() == [name]  # the data holds the name as it is
    snap["title"] = f"commpatch watch {run}"
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=120, color_system=None).print(screen(snap))
    shown = buf.getvalue()
    assert f"on group {terminal_safe(_cut(name))} (seq " in shown
    for c in "\x07\x9b\u2028\u2029\u202e\u2066\u200f":
        assert c not in shown, repr(c)
    assert "\x1b" not in shown  # no styles asked (color_system=None): any ESC would be the file's
    assert max(map(len, shown.splitlines())) <= 120
