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
import tempfile
import threading

import pytest

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


def bounded(argv, timeout_s: float, mem_gb: float = 4.0, env=None):
    """``argv`` in a child process under an address-space limit of ``mem_gb``, killed after
    ``timeout_s``: (exit status, stdout, stderr, peak resident MB)."""
    limit = int(mem_gb * (1 << 30))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, preexec_fn=cap, env=env)
        timer = threading.Timer(timeout_s, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return (
            p.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage.ru_maxrss / 1024,
        )


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
    code, _, err, peak = bounded(
        [sys.executable, "-m", "commpatch", "report", run, "--html", page, "--no-progress"], timeout_s=240
    )
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
