"""The report for people: the headline (one computation, the same figures in text, JSON and HTML),
the text report within 120 columns (at 1,024 ranks too), and the HTML page (``--html``) in a
real headless Chromium driven by Playwright: no console error, every plot drawn, tables that
sort on a click, nothing fetched from the network, sized by aggregates at 1,024 ranks."""

import json
import os
import re
import shutil
import statistics

import pytest

from commpatch import cli
from commpatch.render import html, people
from commpatch.testing import write_binary_run, write_rank_files

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    write_rank_files(str(out), 4, 8, p2p=True, straggler=1, straggler_delay_us=8000.0, mismatch=(3, 12))
    return str(out)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """1,024 ranks (tensor- and data-parallel groups, a world group, point-to-point pairs), 12 steps,
    and their text report and HTML page."""
    out = tmp_path_factory.mktemp("w1024")
    write_binary_run(str(out / "run"), 1024, 120, straggler=700, mismatch=None)
    page = str(out / "report.html")
    code, text = report(str(out / "run"), "--html", page)
    assert code == 0
    return dict(dir=str(out / "run"), text=text, page=page)


def report(*argv):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["report", *argv, "--no-progress"])
    return code, buf.getvalue()


def page_data(path) -> dict:
    text = open(path, encoding="utf-8").read()
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_headline_is_the_same_figures_in_text_json_and_html(logs, tmp_path):
    code, out = report(logs, "--format", "json")
    rep = json.loads(out)
    h = rep["headline"]
    steps = [s for s in rep["sections"]["steps"] if s["stage"] == "steady"]
    times = sorted(s["step_us"] for s in steps)
    assert h["steady_steps"] == len(steps) == 6 and h["steps"] == 8
    assert h["step_us"] == pytest.approx((times[2] + times[3]) / 2)  # the median steady step
    assert h["exposed_share"] == pytest.approx(statistics.median(s["exposed_share"] for s in steps))
    assert h["comm_share"] == pytest.approx(statistics.median(s["comm_share"] for s in steps))
    top = _steady_top_of(logs)  # the steady-state summary's row, as the analysis API gives it
    assert {k: h["top_collective"][k] for k in ("collective", "size_bucket", "count")} == {
        k: top[k] for k in ("collective", "size_bucket", "count")
    }
    for k in ("time_share", "busbw_gbps", "total_us"):  # the sections' JSON keeps 10 significant digits
        assert h["top_collective"][k] == pytest.approx(top[k], rel=1e-9)
    assert h["mismatches"] == len(rep["sections"]["mismatches"]) == 1
    assert h["first_mismatch"] == dict(kind="bytes", group="0", coll_seq=12, step=2, op="broadcast")
    s = h["straggler"]
    assert s["verdict"] == "straggler" and s["rank"] == 1 and s["last_steps"] == s["steps"] == 6
    straggler = next(f["text"] for f in rep["findings"] if f["kind"] == "straggler")
    assert "the straggler" in straggler and f"{s['p_value']:.2g}" in straggler
    assert h["hang"]["verdict"] == "none_seen"
    # the text report's headline: the same words from the same numbers, first
    code, text = report(logs)
    lines = text.splitlines()
    assert lines[2] == "Headline:"
    shown = " ".join(" ".join(lines[3 : lines.index("Findings:")]).split())
    for label, sentence in people.headline_lines(h):
        assert f"{label}: {sentence}" in shown
    assert f"step time: {people._ms(h['step_us'])} median" in shown and "straggler: rank 1: others wait " in shown
    # the page holds the same headline
    path = str(tmp_path / "r.html")
    assert report(logs, "--html", path)[0] == 0
    data = page_data(path)
    assert data["headline"] == h
    assert data["headline_text"] == [list(p) for p in people.headline_lines(h)]


def test_headline_says_unknown_for_one_rank(logs):
    rep = json.loads(report(os.path.join(logs, "rank0.csv"), "--format", "json")[1])
    h = rep["headline"]
    assert h["straggler"]["verdict"] == "unknown" and h["hang"]["verdict"] == "unknown" and h["mismatches"] is None
    text = report(os.path.join(logs, "rank0.csv"))[1]
    # the rows say the job had 4 ranks: the missing logs are named (a forgotten host), not "one rank"
    assert "straggler:      unknown (no log for rank(s) 1-3: only one rank's log read)" in text, text
    assert "mismatches:     not checked" in text


@pytest.mark.slow  # 1,024 ranks written and reported: `make test-slow`
def test_text_report_fits_120_columns_at_1024_ranks(big):
    lines = big["text"].splitlines()
    assert lines[2] == "Headline:" and "1024 rank(s) 0-1023" in lines[0]
    assert max(map(len, lines)) <= people.WIDTH, max(lines, key=len)
    # the full tables stay behind --wide
    wide = report(big["dir"], "--wide")[1]
    assert max(map(len, wide.splitlines())) > people.WIDTH and " overlap_unknown_us " in wide


@pytest.mark.slow  # 1,024 ranks written and reported: `make test-slow`
def test_page_is_sized_by_aggregates_at_1024_ranks(big):
    size = os.path.getsize(big["page"])
    assert size < 5e6, size
    data = page_data(big["page"])
    heat = data["plots"]["heatmap"]
    assert len(heat["ranks"]) == 1024 and len(heat["columns"]) <= 200
    timeline = data["plots"]["timeline"]
    assert len(timeline["ranks"]) <= html.EXCERPT_RANKS and 700 in timeline["ranks"]  # the latest rank shown
    assert timeline["of_ranks"] == 1024
    assert all(len(t["rows"]) <= html.MAX_TABLE_ROWS for t in data["tables"].values())


def test_page_offline_by_construction(logs, tmp_path):
    path = str(tmp_path / "r.html")
    assert report(logs, "--html", path)[0] == 0
    text = open(path, encoding="utf-8").read()
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#|data:)""", text)  # nothing loaded from anywhere
    assert "default-src 'none'" in text
    assert "</script>" not in re.search(r'id="data">(.*?)</script>', text, re.S).group(1)


def test_html_option_refuses_a_directory_before_reading(logs, tmp_path, capsys):
    assert cli.main(["report", logs, "--html", str(tmp_path), "--no-progress"]) == 2
    assert "--html" in capsys.readouterr().err


# ---- in a real browser --------------------------------------------------------------------------
def _browser():
    pw = pytest.importorskip(
        "playwright.sync_api", reason="Playwright not installed (pip install playwright: the test extra)"
    )
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian package chromium: ci/apt.sh installs it)")
    return pw


def load(path, screenshot=None, probe=None, timeout_ms=60_000):
    """Open the page in headless Chromium with the network off (an offline context, and every
    request that is not the file itself aborted); returns what the page did (``probe``: a
    function evaluated in the page once drawn, its value as ``out["probe"]``)."""
    pw = _browser()
    out = dict(console=[], requests=[])
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            ctx = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})

            def route(r):
                if r.request.url.startswith("file://") and r.request.url.endswith(os.path.basename(path)):
                    return r.continue_()
                out["requests"].append(r.request.url)
                return r.abort()

            ctx.route("**/*", route)
            page = ctx.new_page()
            page.on(
                "console",
                lambda m: out["console"].append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None,
            )
            page.on("pageerror", lambda e: out["console"].append(f"pageerror: {e}"))
            page.goto("file://" + os.path.abspath(path))
            page.wait_for_selector("html[data-ready='1']", timeout=timeout_ms)
            out["plots"] = page.evaluate("""() => [...document.querySelectorAll('[data-plot]')].map(p => {
                const svg = p.querySelector('svg'), cv = p.querySelector('canvas');
                let marks = 0, inked = 0;
                if (svg) marks = svg.querySelectorAll('rect, circle, polyline[points]:not([points=""])').length;
                if (cv) {
                  const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
                  for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i+1] < 250 || d[i+2] < 250) inked++;
                }
                const box = (svg || cv).getBoundingClientRect();
                return {name: p.dataset.plot, kind: svg ? 'svg' : 'canvas', marks, inked, w: box.width, h: box.height};
            })""")
            out["cards"] = page.eval_on_selector_all("[data-headline]", "els => els.map(e => e.dataset.headline)")
            out["sections"] = page.eval_on_selector_all("main > section", "els => els.map(e => e.id)")
            out["markers"] = page.eval_on_selector_all("[data-step-marker]", "els => els.length")
            out["advice"] = page.eval_on_selector_all("#advice .advice", "els => els.map(e => e.innerText)")
            out["sort"] = _sort_check(page) if page.query_selector("table[data-table='ranks']") else None
            out["probe"] = page.evaluate(probe) if probe else None
            if screenshot:
                page.screenshot(path=screenshot, full_page=True)
        finally:
            browser.close()
    return out


def _sort_check(page):
    """Click the ranks table's 'rank' header twice: the column ascending, then descending."""

    def column():
        return page.eval_on_selector_all(
            "table[data-table='ranks'] tbody tr td:first-child", "els => els.map(e => Number(e.textContent))"
        )

    before = column()
    header = page.locator("table[data-table='ranks'] th", has_text=re.compile(r"^rank$"))
    header.click()
    up = column()
    header.click()
    down = column()
    return dict(before=before, up=up, down=down, state=header.get_attribute("aria-sort"))


def check_page(out, plots):
    assert out["console"] == []
    assert out["requests"] == []
    assert sorted(p["name"] for p in out["plots"]) == sorted(plots)
    for p in out["plots"]:
        assert p["w"] > 100 and p["h"] > 50, p
        assert (p["marks"] if p["kind"] == "svg" else p["inked"]) > 0, p


def test_page_in_headless_chromium(logs, tmp_path):
    path = str(tmp_path / "r.html")
    assert report(logs, "--html", path)[0] == 0
    lines = "() => [...document.querySelectorAll('[data-line] polyline')].map(p => +p.getAttribute('stroke-width'))"
    out = load(path, probe=lines)
    check_page(out, ["bandwidth", "steps", "heatmap", "timeline"])
    assert out["cards"] == ["step time", "communication", "top collective", "straggler", "hang", "mismatches"]
    comm, exposed = out["probe"]  # the communication share wide under the exposed one: both show where they coincide
    assert comm >= exposed + 2, out["probe"]
    advised = bool(json.loads(report(logs, "--format", "json")[1])["advice"])  # advice, when given, after the findings
    assert out["sections"][: 3 + advised] == ["headline", "findings"] + ["advice"] * advised + ["plots"]
    assert {"table-summary", "table-steps", "table-ranks", "table-mismatches"} <= set(out["sections"])
    assert out["markers"] == 4  # each rank's step start in the timeline excerpt
    s = out["sort"]
    assert s["before"][0] == 1  # stragglers first, as the table comes
    assert s["up"] == [0, 1, 2, 3] and s["down"] == [3, 2, 1, 0] and s["state"] == "descending"


def test_pages_of_one_rank_and_of_one_step_in_headless_chromium(logs, tmp_path):
    """What a log cannot show is left out (no heatmap for one rank), never drawn empty or broken."""
    one = str(tmp_path / "one.html")
    assert report(os.path.join(logs, "rank0.csv"), "--html", one)[0] == 0
    out = load(one)
    check_page(out, ["bandwidth", "steps", "timeline"])
    assert out["sort"] is None and out["cards"][3] == "straggler"
    write_rank_files(str(tmp_path / "single"), 2, 1)
    single = str(tmp_path / "single.html")
    assert report(str(tmp_path / "single"), "--html", single)[0] == 0
    assert page_data(single)["headline"]["step_us"] is None
    assert page_data(single)["plots"]["timeline"]["stage"] == "end"
    check_page(load(single), ["bandwidth", "steps", "heatmap", "timeline"])


@pytest.mark.slow  # 1,024 ranks written and reported: `make test-slow`
def test_page_at_1024_ranks_in_headless_chromium(big):
    out = load(big["page"])
    check_page(out, ["bandwidth", "steps", "heatmap", "timeline"])
    assert out["sort"]["up"][:3] == [0, 1, 2] and out["sort"]["down"][:3] == [1023, 1022, 1021]


def test_advice_items_are_listed_when_the_report_has_them(logs, tmp_path):
    from commpatch import io as cpio
    from commpatch.render import text

    rep = text.build_report(cpio.read(logs))
    rep.advice = [
        dict(
            title="Larger DDP buckets",
            evidence="41 all_reduce calls per step below 1 MB",
            change="DDP(bucket_cap_mb=100)",
            gain="about 3 ms per step",
        )
    ]
    path = html.write(html.page(rep), str(tmp_path / "a.html"))
    out = load(path)
    assert out["console"] == [] and len(out["advice"]) == 1
    assert "Larger DDP buckets" in out["advice"][0] and "bucket_cap_mb=100" in out["advice"][0]
    # or as a table of the report
    import pandas as pd

    del rep.advice
    rep.sections["advice"] = pd.DataFrame([dict(title="Fewer small all_reduce calls", gain_us=3000.0)])
    assert html.report_data(rep)["advice"] == [dict(title="Fewer small all_reduce calls", gain_us=3000.0)]
    assert "advice" not in html.report_data(rep)["tables"]


def test_advice_reads_as_the_text_report_and_the_page_never_scrolls_sideways(logs, tmp_path):
    """Issue 36: the page's advice was a dump of internal fields (``evidence {...}``, ``gain_share
    0.392398``) and one unbroken line made the page 2,741 px wide at a 1,280 px viewport. Now each
    item reads as in the text report (title and why, the change, the expected gain, rule and
    table), its evidence apart with units ("unknown" for an unknown value, never 0), and nothing is
    wider than the viewport."""
    import math

    from commpatch import io as cpio
    from commpatch.analysis.advice import Advice
    from commpatch.render import text

    rep = text.build_report(cpio.read(logs))
    change = "DistributedDataParallel(model, bucket_cap_mb=25, " + "x" * 400 + ")"  # one unbroken word
    rep.advice = [
        Advice(
            rule="ddp_buckets",
            title="Larger DDP buckets",
            evidence={"tail_us": 27000.0, "bucket_bytes": 2 * 2**20, "hidden_share": math.nan},
            change=change,
            gain_us=3000.0,
            gain_share=0.392398,
            text="the last bucket's all_reduce waits 27 ms after the backward pass",
        )
    ]
    path = html.write(html.page(rep), str(tmp_path / "a.html"))
    out = load(path, probe="() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert out["console"] == [] and len(out["advice"]) == 1
    shown = out["advice"][0]
    assert shown.startswith("Larger DDP buckets: the last bucket's all_reduce waits 27 ms"), shown
    assert f"change: {change}" in shown.replace("\n", "")
    assert "expected gain: about 3 ms per step (39% of the step) [rule: ddp_buckets; table: steps]" in shown, shown
    assert "gain_share" not in shown and "0.392398" not in shown and "{" not in shown.replace(change, "")
    width, viewport = out["probe"]
    assert width <= viewport, (width, viewport)
    evidence = html.report_data(rep)["advice"][0]["evidence"]
    assert evidence == {"tail_us": 27000.0, "bucket_bytes": 2 * 2**20, "hidden_share": None}


def test_compare_page_in_headless_chromium(tmp_path):
    runs = []
    for n in (2, 4, 8):
        runs.append(str(tmp_path / f"w{n}"))
        write_rank_files(runs[-1], n, 5)
    path = str(tmp_path / "scaling.html")
    assert cli.main(["report", "--compare", *runs, "--html", path, "--no-progress"]) == 0
    out = load(path)
    check_page(out, ["scaling-step", "scaling-efficiency", "scaling-shares", "scaling-busbw"])
    assert page_data(path)["plots"]["scaling"]["world_size"] == [2, 4, 8]


def test_engine_report_has_the_same_headline_and_a_timeline(tmp_path):
    """At scale (DuckDB, no rows in memory) the headline is computed from the same tables; the
    page's timeline excerpt reads that one step of a few ranks only."""
    pytest.importorskip("duckdb", reason="DuckDB not installed (pip install 'commpatch[scale]')")
    write_binary_run(str(tmp_path / "run"), 32, 200, straggler=9, mismatch=(5, 7))
    heads = {}
    for engine in ("pandas", "duckdb"):
        heads[engine] = json.loads(report(str(tmp_path / "run"), "--engine", engine, "--format", "json")[1])["headline"]
    a, b = heads["pandas"], heads["duckdb"]
    assert (
        a["straggler"]["verdict"] == b["straggler"]["verdict"] and a["straggler"]["rank"] == b["straggler"]["rank"] == 9
    )
    assert a["first_mismatch"] == b["first_mismatch"] and a["mismatches"] == b["mismatches"] >= 1
    assert a["top_collective"]["collective"] == b["top_collective"]["collective"]
    assert a["step_us"] == pytest.approx(b["step_us"], rel=1e-6) and a["steady_steps"] == b["steady_steps"]
    path = str(tmp_path / "r.html")
    assert report(str(tmp_path / "run"), "--engine", "duckdb", "--html", path)[0] == 0
    timeline = page_data(path)["plots"]["timeline"]
    assert timeline["of_ranks"] == 32 and 9 in timeline["ranks"] and len(timeline["ranks"]) == html.EXCERPT_RANKS
    assert {c[0] for c in timeline["calls"]} == set(timeline["ranks"])


# ---- figures users misread (issue 32, item 9) -----------------------------------------------------
def _steady_top_of(logs):
    """The steady-state summary's top row of the logs in ``logs``, with the report's bandwidth
    (the arrival-free transfer time)."""
    import warnings

    import commpatch
    from commpatch.analysis import matching
    from commpatch.render.text import build_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = commpatch.read_csv(logs)
    return _steady_top(matching.with_transfer(df), build_report(df))


def _steady_top(df, rep):
    """The steady-state summary's row with the most time, as the analysis API computes it."""
    from commpatch.analysis import steps, summaries

    rows = steps.steady_rows(df, rep.sections["steps"])
    s = summaries.summary(rows, by=["collective", "size_bucket"])
    return s.loc[s["total_us"].idxmax()]


def test_headline_top_collective_is_the_steady_states_not_set_up():
    """A set-up all_gather (step 0: DDP's parameter check) that takes longer than every steady-state
    call together was the headline's top collective."""
    from commpatch.render.text import build_report
    from commpatch.testing import make_log

    df = make_log(2, 10)
    setup = (df["step"] == 0) & (df["op"] == "all_gather_into_tensor")
    df.loc[setup, "duration_us"] *= 1000
    df.loc[setup, "own_us"] *= 1000
    rep = build_report(df)
    whole = rep.sections["summary"]
    assert str(whole.loc[whole["total_us"].idxmax(), "collective"]) == "all_gather"  # set-up dominates the run
    top, want = rep.headline["top_collective"], _steady_top(df, rep)
    assert top["steady_state"] and (top["collective"], top["size_bucket"]) == ("all_reduce", 1 << 22)
    assert (top["collective"], top["size_bucket"], top["count"]) == (
        want["collective"],
        want["size_bucket"],
        want["count"],
    )
    assert top["total_us"] == pytest.approx(want["total_us"]) and top["time_share"] == pytest.approx(want["time_share"])
    sentence = dict(people.headline_lines(rep.headline))["top collective"]
    assert sentence.startswith("all_reduce <= 4.19 MB:") and "of communication time (steady state, " in sentence


def test_untimed_calls_have_unknown_time_never_0_and_are_never_the_top():
    """gloo's isend / irecv have no duration: the summary said total_us 0.0 and time_share 0.0%, and
    the headline's top collective was then a set-up call."""
    import numpy as np

    from commpatch.render.text import build_report
    from commpatch.testing import make_log

    df = make_log(2, 10, p2p=True)
    p2p = df["op"].isin(["send", "recv"])
    assert p2p.any()
    df.loc[p2p, ["duration_us", "own_us"]] = np.nan
    df.loc[~p2p & (df["step"] > 0), ["duration_us", "own_us"]] = np.nan  # only set-up is timed
    rep = build_report(df)
    s = rep.sections["summary"]
    untimed = s[s["collective"].astype(str).isin(["send", "recv"])]
    assert len(untimed) and untimed[["total_us", "own_us", "transfer_us", "time_share"]].isna().all().all()
    assert rep.headline["top_collective"] is None or not rep.headline["top_collective"]["steady_state"]
    assert rep.headline["top_collective"]["collective"] not in ("send", "recv")


def test_headline_shows_waiting_and_ddps_own_work_apart():
    """DDP's packing and finalize are the training thread's own work, counted exposed: the headline
    said all of it was waiting."""
    import pandas as pd

    from commpatch.analysis.headline import headline

    steps = pd.DataFrame(
        dict(
            step=range(6),
            stage=["setup"] + ["steady"] * 4 + ["end"],
            calls=4.0,
            unmeasured=0.0,
            comm_us=50.0,
            busy_us=70.0,
            exposed_us=40.0,
            overlap_unknown_us=0.0,
            ddp_finalize_us=5.0,
            ddp_pack_us=10.0,
            step_us=100.0,
            comm_share=0.7,
            exposed_share=0.4,
        )
    )
    h = headline(steps, None)
    assert h["exposed_share"] == pytest.approx(0.4)
    assert h["wait_share"] == pytest.approx(0.25) and h["framework_share"] == pytest.approx(0.15)
    sentence = dict(people.headline_lines(h))["communication"]
    assert "exposed 40% (the overhead: the training thread waits 25%, DDP's packing and finalize on it 15%)" in sentence
    assert "in flight 70% of the step (issue to completion, backend queue included)" in sentence


def test_straggler_unknown_says_how_many_steady_steps_it_could_compare():
    """Pipelining (point-to-point calls only): "straggler: unknown (too few steady-state steps)"
    beside "18 steady-state steps"; the sentence now says which steps the verdict could use."""
    h = dict(
        steps=20,
        steady_steps=18,
        step_us=1000.0,
        step_p95_us=1100.0,
        straggler=dict(verdict="unknown", rank=None, steps=0, last_steps=0, reason="steps"),
    )
    lines = dict(people.headline_lines(h))
    assert "(18 steady-state steps of 20)" in lines["step time"]
    assert lines["straggler"].startswith("unknown: 0 of the 18 steady-state steps have a collective that two or more")


@pytest.mark.parametrize("engine", ["pandas", "duckdb"])
def test_heatmap_ticks_on_whole_steps(tmp_path, engine):
    """The skew heatmap's columns are collectives in order, binned; its ticks are steps: each at the
    first column of that step, labelled with the job's step number, on the PNG (matplotlib) and the
    page alike, from either engine (they said a collective number counted from 0, labelled "sequence
    in its group", which it is not)."""
    import matplotlib

    matplotlib.use("Agg")

    import commpatch
    from commpatch import offline
    from commpatch.render import plots
    from commpatch.testing import make_log

    df = make_log(2, 40, seed=3)
    df["step"] = df["step"] + 100  # the job's own numbering
    for rank, frame in df.groupby("rank", observed=True):
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=frame.reset_index(drop=True))
    with offline.open(str(tmp_path), engine=engine) as run:
        arrivals = run._plots_data()[1]
    steps = arrivals.attrs["steps"]
    assert len(steps) == len(arrivals.columns) and steps == sorted(steps) and steps[0] == 100, steps
    # each column's first step is that of the first collective it holds
    per_coll = df[df["rank"] == 0].sort_values("seq")["step"].to_numpy()
    assert all(steps[j] == per_coll[c] for j, c in enumerate(arrivals.columns)), (steps, list(arrivals.columns))
    ticks = plots.step_ticks(steps)
    assert 2 <= len(ticks) <= 10 and all(t == 0 or steps[t] != steps[t - 1] for t in ticks), ticks
    shown = [steps[t] for t in ticks]
    assert len(set(shown)) == len(shown) and len({b - a for a, b in zip(shown, shown[1:])}) == 1, (
        shown
    )  # every k-th step
    fig = plots.skew_heatmap(arrivals)
    ax = fig.axes[0]
    assert [int(t.get_text()) for t in ax.get_xticklabels()] == [steps[t] for t in ticks]
    assert list(ax.get_xticks()) == ticks and ax.get_xlabel().startswith("step")
    data = html.heatmap_data(arrivals)
    assert data["steps"] == steps and data["columns"] == [int(c) for c in arrivals.columns]
    assert len(data["ms"]) == 2 and all(len(row) == len(steps) for row in data["ms"])


def test_diff_page_in_headless_chromium(tmp_path, capsys):
    """``commpatch diff A B --html FILE``: the diff as a page worded as the text (the same sentences),
    its significant changes as findings, its tables drawn; nothing loaded, no script error, no
    horizontal scroll at 1,280 px."""
    import commpatch
    from commpatch.testing import make_log

    for name, slower in (("a", 1.0), ("b", 1.6)):
        df = make_log(2, 30, seed=5)
        df["duration_us"] = df["duration_us"] * slower
        df["own_us"] = df["own_us"] * slower
        df["start_ns"] = df["start_ns"] + (df["step"] * 1e6 * (slower - 1) * 10).astype("int64")
        (tmp_path / name).mkdir()
        for rank, frame in df.groupby("rank", observed=True):
            commpatch.export_csv(str(tmp_path / name / f"rank{rank}.csv"), df=frame.reset_index(drop=True))
    page = str(tmp_path / "diff.html")
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--html", page]) == 0
    out = capsys.readouterr()
    assert f"diff page written to {page}" in out.err, out.err
    text_lines = [line[2:] for line in out.out.splitlines() if line.startswith("- ")]
    probe = """() => ({width: document.documentElement.scrollWidth,
        findings: [...document.querySelectorAll('#findings li')].map(li => li.innerText),
        tables: [...document.querySelectorAll('table[data-table]')].map(t => [t.dataset.table, t.rows.length]),
        cells: [...document.querySelectorAll('table[data-table] td')].map(td => td.innerText)})"""
    seen = load(page, probe=probe)
    assert seen["console"] == [] and seen["requests"] == [], seen
    p = seen["probe"]
    assert p["width"] <= 1280, p["width"]
    tables = dict(p["tables"])
    assert tables.get("steps", 0) > 1 and tables.get("collectives", 0) > 1, tables
    significant = [t for t in text_lines if ": significant" in t]
    assert significant, out.out  # the step time grew: the text says so
    shown = [f.replace(" [table: steps]", "").replace(" [table: collectives]", "") for f in p["findings"]]
    for line in significant:  # each significant change of the text is a finding of the page, worded alike
        assert line in shown, (line, shown)
    assert not [c for c in p["cells"] if c in ("nan", "NaN", "None", "null", "")], p["cells"]  # unknown said as such
