"""Tuning advice (issue 27): each rule on crafted logs (the pattern present / absent) and on real jobs
(gloo, 2 ranks); the advice in the text and JSON report with its evidence and change."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from commpatch.analysis import advice as adv
from commpatch.data.frame import apply_schema
from commpatch.data.schema import COLUMNS
from commpatch.render import text as report
from commpatch.testing import make_log

from .advice_workers import ddp_job, fsdp1_reshard_job, fsdp2_job, fsdp2_reshard_job, many_small_calls
from .multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
DEFAULTS = dict(
    seq=0,
    op="all_reduce",
    collective="all_reduce",
    api="all_reduce",
    source="c10d",
    rank=0,
    world_size=2,
    group="0",
    group_size=2,
    group_ranks="0 1",
    group_seq=0,
    backend="gloo",
    device="cpu",
    dtype="float32",
    numel=0,
    bytes=0,
    peer=-1,
    async_op=False,
    start_ns=0,
    host_us=0.0,
    duration_us=0.0,
    own_us=np.nan,
    timing="host",
    algbw_gbps=np.nan,
    busbw_gbps=np.nan,
    status="ok",
    step=0,
    tag="",
    pid=1,
    module="",
    phase="other",
    bucket=-1,
    bucket_params=0,
    tensors=1,
    step_source="user",
    sync_end_us=np.nan,
    pack_us=np.nan,
    pack_alone_us=np.nan,
    wait_us=np.nan,
)
T0 = 1_700_000_000_000_000_000


def _log(rows):
    """A log from row dicts (the other columns at DEFAULTS), seq and group_seq numbered per rank."""
    df = pd.DataFrame([{**DEFAULTS, **r} for r in rows])[list(COLUMNS)]
    df = df.sort_values(["rank", "start_ns"], kind="stable")
    df["seq"] = df.groupby("rank").cumcount()
    df["group_seq"] = df["seq"]
    df["numel"] = df["bytes"] // 4
    return apply_schema(df.reset_index(drop=True))


def _ddp_log(buckets, steps=12, step_us=50_000.0, finalize_us=200.0, ranks=2, late=None, pack_us=np.nan, conf=None):
    """A DDP job's log: per step the ``buckets`` (bytes, issue after the step's start in us, all-reduce
    duration in us, parameters), in issue order; the last one carries the finalize's end. ``late``:
    (rank, us): that rank issues every bucket us later, and the others' all-reduces wait for it (their
    durations grow by as much); ``pack_us``: DDP's packing before each bucket; ``conf``: the DDP settings
    the log noted (``df.attrs["job_notes"]``)."""
    rows = []
    for rank in range(ranks):
        for step in range(steps):
            t0 = step * step_us
            for i, (nbytes, issue_us, dur_us, params) in enumerate(buckets):
                last = i == len(buckets) - 1
                if late is not None:
                    issue_us, dur_us = (issue_us + late[1], dur_us) if rank == late[0] else (issue_us, dur_us + late[1])
                rows.append(
                    dict(
                        op="ddp_bucket_allreduce",
                        api="Reducer.allreduce",
                        source="ddp",
                        rank=rank,
                        step=step,
                        bytes=nbytes,
                        async_op=True,
                        timing="future",
                        start_ns=T0 + int((t0 + issue_us) * 1e3),
                        duration_us=dur_us,
                        own_us=dur_us,
                        bucket=i,
                        bucket_params=params,
                        phase="backward",
                        step_source="optimizer",
                        sync_end_us=dur_us + finalize_us if last else np.nan,
                        pack_us=pack_us,
                    )
                )
    df = _log(rows)
    if conf is not None:
        df.attrs["job_notes"] = [
            {"rank": r, "step_marks": [], "settings": [dict(wrapper="ddp", module="Net", values=conf)]}
            for r in range(ranks)
        ]
    return df


def _advice(df, rule=None):
    rep = report.build_report(df)
    return [a for a in rep.advice if rule is None or a.rule == rule]


# ---- ddp_bucket_size ---------------------------------------------------------------------------
def test_one_bucket_holding_all_gradients_gets_a_smaller_cap():
    # 8 MiB in one bucket issued at the end of a 30 ms backward; its all-reduce takes 10 ms, all exposed
    df = _ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)])
    (a,) = _advice(df, "ddp_bucket_size")
    assert a.setting == {"bucket_cap_mb": 2.0} and a.change == "DistributedDataParallel(model, bucket_cap_mb=2)"
    ev = a.evidence
    assert ev["buckets"] == 1 and ev["last_bucket_bytes"] == 8 * MIB and ev["tail_us"] == pytest.approx(10_200.0)
    assert ev["hidden_share"] == pytest.approx(0.0, abs=1e-9) and ev["us_per_mib"] == pytest.approx(1250.0)
    # the new tail: a 2 MiB bucket at the measured 1.25 ms per MiB, the finalize; the rest fits the backward
    assert ev["predicted_tail_us"] == pytest.approx(2 * 1250.0 + 200.0)
    assert a.gain_us == pytest.approx(10_200.0 - 2700.0) and a.gain_share == pytest.approx(7500.0 / 50_000.0)
    assert "10.2 ms per step" in a.text and "On CPU" in a.text


def test_split_buckets_get_no_bucket_advice():
    # the same 8 MiB in four buckets during the backward: the tail is the last 2 MiB bucket (5% of the step)
    df = _ddp_log(
        [
            (2 * MIB, 0.0, 2500.0, 4),
            (2 * MIB, 10_000.0, 2500.0, 4),
            (2 * MIB, 20_000.0, 2500.0, 4),
            (2 * MIB, 30_000.0, 2500.0, 4),
        ]
    )
    assert _advice(df, "ddp_bucket_size") == []


def test_weak_evidence_gets_no_bucket_advice():
    one = [(8 * MIB, 30_000.0, 10_000.0, 16)]
    assert _advice(_ddp_log(one, steps=5), "ddp_bucket_size") == []  # 3 steady steps
    assert _advice(_ddp_log([(8 * MIB, 30_000.0, 2000.0, 16)]), "ddp_bucket_size") == []  # a 4% tail
    # one parameter of 8 MiB: no smaller bucket can hold it
    assert _advice(_ddp_log([(8 * MIB, 30_000.0, 10_000.0, 1)]), "ddp_bucket_size") == []
    # the all-reduce is most of the step: the other buckets' transfer cannot hide under its backward
    assert _advice(_ddp_log([(8 * MIB, 2000.0, 46_000.0, 16)]), "ddp_bucket_size") == []


# ---- ddp_grad_copy -----------------------------------------------------------------------------
TWO_BUCKETS = [(2 * MIB, 0.0, 2500.0, 4), (2 * MIB, 30_000.0, 2500.0, 4)]


def test_long_finalize_gets_gradient_as_bucket_view():
    df = _ddp_log(TWO_BUCKETS, finalize_us=3000.0, pack_us=1000.0)
    (a,) = _advice(df, "ddp_grad_copy")
    assert a.setting == {"gradient_as_bucket_view": True} and a.evidence["finalize_us"] == pytest.approx(3000.0)
    assert a.evidence["pack_us"] == pytest.approx(2000.0)
    assert a.evidence["bucket_bytes"] == 4 * MIB and "4 MiB" in a.title
    assert _advice(_ddp_log(TWO_BUCKETS), "ddp_grad_copy") == []


def test_gradient_copy_advice_claims_only_the_copy_the_flag_removes():
    """With torch's default zero_grad(set_to_none=True) each step's gradients are new tensors and DDP
    copies them into its buckets again whatever the flag: the flag removes the copy back into .grad,
    and the copy in only where .grad is kept between steps (torch's own batched_grad_copy docs say so)."""
    (a,) = _advice(_ddp_log(TWO_BUCKETS, finalize_us=3000.0, pack_us=1000.0), "ddp_grad_copy")
    assert "two copies" not in a.title and "copy of 4 MiB back into .grad" in a.title, a.title
    assert "both copies" not in a.text and "set_to_none=False" in a.text and "copies in again" in a.text, a.text


def test_gradient_copy_gain_is_not_the_finalize():
    # issue 32 item 9: a 3.77 ms finalize (mostly the hooks and the thread's wake-up) was promised as the gain
    # where the flag saved 0.29 ms: the log does not time the copies, so no gain is promised, and the text says why
    (a,) = _advice(_ddp_log(TWO_BUCKETS, finalize_us=3000.0, pack_us=1000.0), "ddp_grad_copy")
    assert np.isnan(a.gain_us) and np.isnan(a.gain_share) and "gain is not predicted" in a.text
    # the job has the flag already: never advised again
    conf = dict(bucket_cap_mb=25.0, gradient_as_bucket_view=True, static_graph=False, find_unused_parameters=False)
    assert _advice(_ddp_log(TWO_BUCKETS, finalize_us=3000.0, pack_us=1000.0, conf=conf), "ddp_grad_copy") == []


# ---- the job's settings, each wait once, ordered by gain (issue 32 item 7) -----------------------
TAIL_PARAM = [(MIB, 10_000.0, 1200.0, 2), (MIB, 20_000.0, 1200.0, 2), (MIB, 25_000.0, 1200.0, 2)]


def test_a_cap_at_the_advised_size_names_the_parameter_of_the_tail():
    # bucket_cap_mb=1 already; the last bucket is one 2 MiB parameter whose all-reduce is a 20% tail
    conf = dict(
        bucket_cap_mb=1.0,
        gradient_as_bucket_view=False,
        static_graph=False,
        find_unused_parameters=False,
        first_params=[["embed.weight", 2 * MIB], ["embed.bias", 4096]],
    )
    df = _ddp_log(TAIL_PARAM + [(2 * MIB, 30_000.0, 10_000.0, 1)], conf=conf)
    rules = {a.rule: a for a in _advice(df)}
    assert "ddp_bucket_size" not in rules  # never the current setting, nor one that cannot split the bucket
    a = rules["ddp_tail_parameter"]
    assert "embed.weight" in a.title and "embed.weight" in a.change and "bucket_cap_mb" not in a.setting
    assert "the job's is 1" in a.text and np.isnan(a.gain_us) and "not predicted" in a.text
    assert "On CPU (gloo) the fp16 compression hook costs more than it saves" in a.text
    # several parameters in a bucket the job's cap already made as small as advised: a cap half the current
    conf["bucket_cap_mb"] = 8.0
    (b,) = _advice(_ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)], conf=conf), "ddp_bucket_size")
    assert b.setting["bucket_cap_mb"] < 8.0 and b.evidence["current_bucket_cap_mb"] == 8.0
    conf["bucket_cap_mb"] = 2.0
    (c,) = _advice(_ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)], conf=conf), "ddp_bucket_size")
    assert c.setting == {"bucket_cap_mb": 1.0}


def test_a_stragglers_wait_is_not_also_the_last_buckets_tail():
    # rank 1 issues its one bucket 30 ms late: rank 0's all-reduce waits 30 ms for it; from the last rank's
    # issue the tail is 3.2 ms of a 70 ms step (below BUCKET_TAIL_SHARE): only the straggler claims the wait
    df = _ddp_log([(8 * MIB, 30_000.0, 3000.0, 16)], step_us=70_000.0, late=(1, 30_000.0))
    rules = [a.rule for a in _advice(df)]
    assert "straggler" in rules and "ddp_bucket_size" not in rules
    bs = adv.bucket_steps(df.pipe(_with_steps), report._steps.per_step(df, by_rank=False))
    assert bs["tail_us"].max() == pytest.approx(3200.0, abs=1.0)


def _with_steps(df):
    from commpatch.analysis import matching

    return matching.with_transfer(df, matching.cross_rank(df))


def test_advice_is_ordered_by_gain():
    # a straggler (30 ms late: the larger gain), a large bucket tail from the last rank's issue and a long
    # finalize (gain unknown) in one job: the larger gain first, unknown gains last
    df = _ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)], step_us=90_000.0, finalize_us=3000.0, late=(1, 30_000.0))
    items = _advice(df)
    assert [a.rule for a in items] == ["straggler", "ddp_bucket_size", "ddp_grad_copy"], items
    assert items[0].gain_us > items[1].gain_us and np.isnan(items[2].gain_us)
    assert adv.by_gain([items[2], items[1], items[0]]) == items


# ---- small_messages ----------------------------------------------------------------------------
def _calls_log(sizes_per_step, steps=12, latency_us=100.0, us_per_byte=0.001, compute_us=5000.0):
    """Blocking all_reduce calls of ``sizes_per_step`` each step, timed latency + bytes x us_per_byte."""
    rows = []
    for rank in range(2):
        t = 0.0
        for step in range(steps):
            t += compute_us
            for nbytes in sizes_per_step:
                dur = latency_us + nbytes * us_per_byte
                rows.append(
                    dict(rank=rank, step=step, bytes=nbytes, start_ns=T0 + int(t * 1e3), duration_us=dur, own_us=dur)
                )
                t += dur
    return _log(rows)


def test_many_small_calls_get_coalesced():
    df = _calls_log([64] * 20 + [MIB] * 3)
    (a,) = _advice(df, "small_messages")
    ev = a.evidence
    assert ev["calls_per_step"] == 20 and ev["latency_us"] == pytest.approx(100.0)
    assert ev["latency_bound_bytes"] == pytest.approx(100_000.0)
    # now 20 calls of 100.064 us back to back; one call of 1280 B: 100 us + 1.28 us
    assert ev["small_us_per_step"] == pytest.approx(20 * 100.064) and ev["predicted_us"] == pytest.approx(101.28)
    assert a.gain_us == pytest.approx(20 * 100.064 - 101.28) and "_coalescing_manager" in a.change
    assert a.setting == {}


def test_coalesced_calls_get_no_advice():
    assert _advice(_calls_log([64 * 20] + [MIB] * 3), "small_messages") == []  # already one call
    assert _advice(_calls_log([64] * 4 + [MIB] * 3), "small_messages") == []  # too few calls


def test_one_size_of_small_calls_gets_coalesced():
    # issue 32 item 8: the tutorial's per-gradient loop, calls of one size only (no latency fit): advised,
    # one call of 1280 B costing what one of 64 B does
    (a,) = _advice(_calls_log([64] * 20), "small_messages")
    assert a.evidence["one_size"] == 1 and a.evidence["calls_per_step"] == 20
    assert a.gain_us == pytest.approx(19 * 100.064) and "one message size" in a.text
    # sizes too close to fit a latency: all of them latency-bound
    (b,) = _advice(_calls_log([64] * 20 + [512] * 3), "small_messages")
    assert b.evidence["calls_per_step"] == 23


def test_small_calls_gain_counts_the_waits_between_ranks():
    # issue 32 item 8: per call rank 1 comes 400 us after rank 0 (its loop's own time), so rank 0 waits
    # 400 us in each of the 20 calls: coalescing saves those waits, not just 19 latencies (1.9 ms)
    rows = []
    for step in range(12):
        t = step * 30_000.0
        for nbytes in [64] * 20 + [MIB] * 3:
            dur = 100.0 + nbytes * 0.001
            for rank, lag in ((0, 0.0), (1, 400.0)):
                wait = 400.0 - lag
                rows.append(
                    dict(
                        rank=rank,
                        step=step,
                        bytes=nbytes,
                        start_ns=T0 + int((t + lag) * 1e3),
                        duration_us=dur + wait,
                        own_us=dur + wait,
                    )
                )
            t += dur + 400.0
    (a,) = _advice(_log(rows), "small_messages")
    assert a.evidence["latency_us"] == pytest.approx(100.0, rel=0.01)
    # rank 0: 20 calls of 500 us; rank 1: 20 of 100 us and 19 gaps of 400 us between them; the median of both
    spent = (20 * 500.064 + 20 * 100.064 + 19 * 400.0) / 2
    assert a.evidence["small_us_per_step"] == pytest.approx(spent) and a.gain_us > 9_000.0


# ---- straggler ---------------------------------------------------------------------------------
def _marks(rank, input_us, cpu_us, steps=30):
    """A rank's job notes: per step its start and first forward (``input_us`` later), ``cpu_us`` of
    thread CPU time per step, 0.1 ms of it before the forward."""
    marks = []
    for step in range(1, steps + 1):
        ns, cpu = T0 + step * 50_000_000, step * int(cpu_us * 1e3)
        marks += [(step, 0, ns, cpu), (step, 1, ns + int(input_us * 1e3), cpu + 100_000)]
    return {"rank": rank, "step_marks": marks, "settings": []}


def _straggler_log(rank0=None, rank1=None):
    df = make_log(world_size=2, steps=30, straggler=1, straggler_delay_us=5000.0, seed=3)
    if rank0 is not None:
        df.attrs["job_notes"] = [_marks(0, *rank0), _marks(1, *rank1)]
    return df


def test_straggler_advice_names_the_rank_and_its_breakdown():
    (a,) = _advice(_straggler_log(), "straggler")
    assert a.evidence["rank"] == 1 and a.evidence["late_us"] > 2000 and a.section == "rank_steps"
    assert {"rank_outside_us", "others_outside_us", "rank_busy_us", "others_busy_us"} <= set(a.evidence)
    # a log without step marks (older, CSV): the cause cannot be told, and the advice says so
    assert a.evidence["cause"] == adv.CAUSES.index("unknown") and "no per-step CPU time" in a.text
    assert _advice(make_log(world_size=2, steps=30, seed=3), "straggler") == []


@pytest.mark.parametrize(
    "rank0, rank1, cause, phrase",
    [
        ((1000, 19_000), (6000, 19_000), "input", "waits on its input"),  # 5 ms more before its forward
        ((1000, 19_000), (1000, 25_000), "work", "does more work"),  # 6 ms more CPU time per step
        ((1000, 19_000), (1000, 19_000), "host", "kept off the CPU"),  # wall time up, CPU time not
        ((1000, 19_000), (1000, 21_000), "host", "kept off the CPU"),  # 2 ms more CPU: not the 5 ms
    ],
)
def test_straggler_cause_from_cpu_and_input_time(rank0, rank1, cause, phrase):
    # issue 32 item 3: more work (CPU time up), kept off the CPU (wall time up, CPU not), waiting on input
    (a,) = _advice(_straggler_log(rank0, rank1), "straggler")
    assert a.evidence["cause"] == adv.CAUSES.index(cause) and phrase in a.text, a.text
    assert a.evidence["rank_cpu_us"] == rank1[1] and a.evidence["others_cpu_us"] == rank0[1]


def test_straggler_figures_are_the_tables():
    # issue 32 item 3: every figure the advice quotes is a cell of the report's rank_steps table, which
    # counts every call in flight (async ones too): rank 0 also issues an async call per step
    df = _straggler_log((1000, 19_000), (1000, 25_000))
    extra = df[(df["rank"] == 0) & (df["op"] == "broadcast")].copy()
    extra["async_op"], extra["timing"], extra["start_ns"] = True, "future", extra["start_ns"] - 3_000_000
    df2 = apply_schema(pd.concat([df, extra], ignore_index=True))
    df2.attrs = df.attrs
    rep = report.build_report(df2)
    (a,) = [a for a in rep.advice if a.rule == "straggler"]
    table = rep.sections["rank_steps"].set_index("rank")
    own, others = table.loc[1], table.drop(index=1)
    assert table.loc[0, "busy_us"] > table.loc[0, "exposed_us"]  # the async call is in flight, not exposed
    for col in adv.RANK_STEP_COLUMNS[1:]:
        assert a.evidence[f"rank_{col}"] == own[col]
        assert a.evidence[f"others_{col}"] == pytest.approx(float(np.nanmedian(others[col])))
    for col in ("outside_us", "busy_us", "cpu_us"):
        assert f"{adv._ms(own[col])} against {adv._ms(float(np.nanmedian(others[col])))}" in a.text
    data = json.loads(report.render_report_json(rep))
    assert [r["busy_us"] for r in data["sections"]["rank_steps"]] == pytest.approx(list(table["busy_us"]))
    assert "Ranks' steps" in report.render_report_text(rep, wide=True)


# ---- the report ----------------------------------------------------------------------------------
def test_advice_in_the_text_and_json_report():
    rep = report.build_report(_ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)]))
    data = json.loads(report.render_report_json(rep))
    (item,) = [a for a in data["advice"] if a["rule"] == "ddp_bucket_size"]
    assert tuple(item) == adv.KEYS and item["setting"] == {"bucket_cap_mb": 2.0}
    assert all(v is None or isinstance(v, (int, float)) for v in item["evidence"].values())
    text = report.render_report_text(rep)
    assert text.index("Findings:") < text.index("Advice") < text.index("Per collective")
    assert "change: DistributedDataParallel(model, bucket_cap_mb=2)" in text
    assert "## Advice" in report.render_report_markdown(rep)
    assert report.build_report(_ddp_log([(8 * MIB, 30_000.0, 2000.0, 16)])).advice == []


# ---- real jobs -----------------------------------------------------------------------------------
def test_real_small_calls():
    logs = run_ranks(many_small_calls, 2, timeout=240)
    df = apply_schema(pd.concat(logs, ignore_index=True))
    (a,) = _advice(df, "small_messages")
    assert a.evidence["calls_per_step"] == 64 and a.evidence["latency_bound_bytes"] > 64
    logs = run_ranks(many_small_calls, 2, timeout=240, coalesced=True)
    assert _advice(apply_schema(pd.concat(logs, ignore_index=True)), "small_messages") == []


def test_real_one_size_loop_gets_coalesced():
    # issue 32 item 8: 64 all-reduces of one size per step, nothing else (the tutorial's per-gradient loop)
    logs = run_ranks(many_small_calls, 2, timeout=240, big=0)
    (a,) = _advice(apply_schema(pd.concat(logs, ignore_index=True)), "small_messages")
    assert a.evidence["calls_per_step"] == 64 and a.evidence["one_size"] == 1


def test_real_ddp_settings_and_step_marks():
    # issue 32 items 3 and 7: the settings DDP was made with, once per module, its first parameters
    # named; per step the training thread's wall clock and CPU time, at its start and its first forward
    out = run_ranks(ddp_job, 2, timeout=240, bucket_cap_mb=1.0, as_view=True, slow=(1, "input", 30.0))
    for rank, (_df, job) in enumerate(out):
        (notes,) = job
        (conf,) = notes["settings"]
        assert conf["wrapper"] == "ddp" and conf["module"] == "Net"
        values = conf["values"]
        assert values["bucket_cap_mb"] == 1.0 and values["gradient_as_bucket_view"] is True
        assert values["static_graph"] is False and values["find_unused_parameters"] is False
        assert values["first_params"][0] == ["embed.weight", 2 * MIB]
        marks = adv.step_marks(job)
        assert sorted(marks["step"]) == list(range(1, 9)) and (marks["rank"] == rank).all()
        steady = marks.dropna(subset=["wall_us"])
        assert len(steady) == 7 and (steady["cpu_us"] > 0).all() and (steady["cpu_us"] <= steady["wall_us"]).all()
        # rank 1 sleeps 30 ms between its step's start and its forward: wall time, not CPU time
        if rank == 1:
            assert (steady["input_us"] >= 30_000).all() and (steady["input_cpu_us"] < steady["input_us"]).all()


def test_real_straggler_causes_told_apart():
    # issue 32 item 3: rank 1 burns 40 ms of CPU per step (more work) or sleeps 40 ms before its forward
    # (its input); the cause from the real logs' rank_steps table, the verdict as the report would give it
    for kind, cause in (("work", "work"), ("input", "input")):
        out = run_ranks(ddp_job, 2, timeout=240, steps=10, slow=(1, kind, 40.0))
        df = apply_schema(pd.concat([d for d, _ in out], ignore_index=True))
        job = [j for _, jobs in out for j in jobs]
        by_rank = report._steps.per_step(df, by_rank=True)
        table = adv.rank_steps(by_rank, adv.step_marks(job))
        v = dict(
            rank=1, straggler=True, steps=7, last_steps=7, late_median_us=40_000.0, p_value=0.01, share_of_step=0.5
        )
        (a,) = adv.straggler_advice(v, table, 80_000.0)
        assert a.evidence["cause"] == adv.CAUSES.index(cause), (kind, a.text, table.to_string())


def test_real_fsdp2_settings():
    jobs = run_ranks(fsdp2_job, 2, timeout=240)
    if jobs[0] is None:
        pytest.skip("FSDP2 does not run on CPU with this torch")
    for job in jobs:
        (notes,) = job
        # one record per unit with parameters (the root holds none of its own)
        units = {
            s["module"]: s["values"]["reshard_after_forward"] for s in notes["settings"] if s["wrapper"] == "fsdp2"
        }
        assert units == {"0": False, "2": True} and len(notes["settings"]) == 2
        assert all(s["values"]["mesh"] == [2] for s in notes["settings"])


def test_real_fsdp2_backward_all_gathers_get_the_reshard_advice(tmp_path):
    """FSDP jobs with most of their step exposed got no advice (issue 32, item 8). FSDP2 units that
    reshard after their forward gather their parameters again in the backward: on gloo the training
    thread is inside those all-gathers, and the advice proposes reshard_after_forward=False for them
    with their time per step and the memory it costs; never where the job already has it; nothing
    where the thread's wait for them is unknown (an accelerator's stream), never a 0."""
    import commpatch
    from commpatch.analysis import matching

    poor, good = tmp_path / "reshard", tmp_path / "kept"
    # the poor job keeps unit 0's parameters already: units 1-3 reshard; the good one keeps them all
    for out, reshard in ((poor, True), (good, False)):
        out.mkdir()
        if not all(run_ranks(fsdp2_reshard_job, 2, timeout=240, out=str(out), reshard=reshard, keep=(0,))):
            pytest.skip("FSDP2 does not run on CPU with this torch")
    with commpatch.open(str(poor)) as run:
        rep, df = run.to_dict(), run.rows()
    (item,) = [a for a in rep["advice"] if a["rule"] == "fsdp_reshard"]
    assert item["setting"]["reshard_after_forward"] is False
    assert sorted(item["setting"]["units"]) == ["1", "2", "3"]  # never unit 0: it keeps its parameters
    # the gain: per steady-state step and rank, the units' backward all-gathers' transfer time, summed; the median
    steady = [r["step"] for r in rep["sections"]["steps"] if r["stage"] == "steady"]
    rows = matching.with_transfer(df)
    rows = rows[rows["step"].isin(steady) & (rows["phase"] == "backward") & (rows["collective"] == "all_gather")]
    assert (rows["timing"] == "host").all() and set(rows["module"].astype(str)) == {"1", "2", "3"}
    per_step = rows.groupby(["rank", "step"])["transfer_us"].sum()
    assert len(per_step) == 2 * len(steady) and (rows.groupby(["rank", "step"]).size() == 3).all()
    assert item["gain_us"] == pytest.approx(float(per_step.median()), rel=1e-9)
    assert item["gain_us"] >= 0.05 * item["evidence"]["step_us"]
    gathered = rows.groupby("module", observed=True)["bytes"].first()
    assert item["evidence"]["held_bytes"] == pytest.approx(float(gathered.sum()) / 2)  # less each rank's half
    assert f"{item['gain_us'] / 1e3:.3g} ms per step" in item["title"]
    assert "reshard_after_forward=False" in item["change"]
    # the job that keeps its parameters: no backward all-gather, and the setting it has is not proposed
    with commpatch.open(str(good)) as run:
        kept, kept_rows = run.to_dict(), run.rows()
    assert not ((kept_rows["phase"] == "backward") & (kept_rows["collective"] == "all_gather")).any()
    assert [a for a in kept["advice"] if a["rule"] == "fsdp_reshard"] == []
    # on an accelerator the calls run on FSDP's stream, timed by device events: the thread's wait unknown
    steps_table = report._steps.per_step(df, by_rank=False)
    st = adv.steady_state(steps_table)
    job = df.attrs["job_notes"]
    timed = matching.with_transfer(df)
    device = timed.assign(timing=pd.Categorical(["device_event"] * len(timed)), wait_us=np.nan)
    assert adv.fsdp_reshard(device, steps_table, st, job) == []
    waited = device.assign(wait_us=1e9)  # a wait seen (Work.wait): the exposed time, at most the transfer
    (again,) = adv.fsdp_reshard(waited, steps_table, st, job)
    assert again.gain_us == pytest.approx(item["gain_us"], rel=1e-9)
    assert adv.fsdp_reshard(timed, steps_table, st, []) == []  # no settings noted (CSV, older logs): not advised
    # tensor parallel's functional all-gathers in a unit's backward (attributed to the unit) are not FSDP's
    tp = timed[adv.fsdp_gather_mask(timed)].assign(op="funcol.all_gather", api="all_gather", source="funcol")
    mixed = pd.concat([timed.astype({"op": str, "api": str, "source": str}), tp], ignore_index=True)
    assert len(tp) and adv.fsdp_gather_mask(mixed).sum() == len(tp)
    (same,) = adv.fsdp_reshard(mixed, steps_table, st, job)
    assert same.gain_us == pytest.approx(item["gain_us"], rel=1e-9)
    from commpatch.analysis import engine

    if engine.available():  # the DuckDB engine reads the same rows and advises the same
        from tests.test_engine_parity import assert_same_report

        pandas, _ = assert_same_report(str(poor))
        assert [a["rule"] for a in pandas["advice"]] == [a["rule"] for a in rep["advice"]]


def test_real_fsdp2_resharded_over_fewer_ranks_counts_the_memory_it_would_keep(tmp_path):
    """reshard_after_forward=2 at 4 ranks keeps a half of each unit's parameters between forward and
    backward (not the quarter its mesh shards them to): False costs the other half, which the advice
    says (from the backward all-gathers' group, 2 ranks), not three quarters."""
    import commpatch

    if not all(run_ranks(fsdp2_reshard_job, 4, timeout=240, out=str(tmp_path), reshard=2, steps=10)):
        pytest.skip("FSDP2 does not run on CPU with this torch")
    with commpatch.open(str(tmp_path)) as run:
        rep, df = run.to_dict(), run.rows()
    gathers = df[(df["phase"] == "backward") & (df["collective"] == "all_gather")]
    assert set(gathers["group_ranks"].astype(str)) == {"0 1", "2 3"}  # each pair gathers what it keeps
    (item,) = [a for a in rep["advice"] if a["rule"] == "fsdp_reshard"]
    per_unit = gathers.groupby("module", observed=True)["bytes"].first()
    assert len(per_unit) == 4 and item["evidence"]["held_bytes"] == pytest.approx(float(per_unit.sum()) / 2)


def test_real_fsdp1_full_shard_gets_the_strategy_that_keeps_its_parameters(tmp_path):
    """FSDP1's FULL_SHARD frees each unit's parameters after its forward (not the root's) and gathers
    them again in the backward: its settings note the strategy per unit, and the advice proposes
    SHARD_GRAD_OP for the wrapped units (never the root, which keeps them); a SHARD_GRAD_OP job has no
    backward all-gather and gets none. The engines agree."""
    import commpatch
    from commpatch.analysis import matching

    poor, good = tmp_path / "full", tmp_path / "grad_op"
    digests = {}
    for out, strategy in ((poor, "FULL_SHARD"), (good, "SHARD_GRAD_OP")):
        out.mkdir()
        digests[strategy] = run_ranks(fsdp1_reshard_job, 2, timeout=240, out=str(out), strategy=strategy)
        if not all(digests[strategy]):
            pytest.skip("FSDP1 does not run on CPU with this torch")
    # transparent: the same parameters, bit for bit, with commpatch off (its settings note reads, never writes)
    off = run_ranks(fsdp1_reshard_job, 2, timeout=240, out=str(tmp_path), strategy="FULL_SHARD", record=False)
    assert off == digests["FULL_SHARD"]
    with commpatch.open(str(poor)) as run:
        rep, df = run.to_dict(), run.rows()
    wrapped = [f"_fsdp_wrapped_module.{i}" for i in range(4)]
    for notes in df.attrs["job_notes"]:
        noted = {s["module"]: s["values"] for s in notes["settings"] if s["wrapper"] == "fsdp1"}
        assert noted == {
            "FullyShardedDataParallel": dict(sharding_strategy="FULL_SHARD", reshard_after_forward=False),
            **{name: dict(sharding_strategy="FULL_SHARD", reshard_after_forward=True) for name in wrapped},
        }, noted
    (item,) = [a for a in rep["advice"] if a["rule"] == "fsdp_reshard"]
    assert item["setting"]["sharding_strategy"] == "SHARD_GRAD_OP" and sorted(item["setting"]["units"]) == wrapped
    assert "sharding_strategy=ShardingStrategy.SHARD_GRAD_OP" in item["change"]
    steady = [r["step"] for r in rep["sections"]["steps"] if r["stage"] == "steady"]
    rows = matching.with_transfer(df)
    rows = rows[rows["step"].isin(steady) & (rows["phase"] == "backward") & (rows["collective"] == "all_gather")]
    assert sorted(set(rows["module"].astype(str))) == wrapped  # the root gathers nothing in the backward
    assert item["gain_us"] == pytest.approx(float(rows.groupby(["rank", "step"])["transfer_us"].sum().median()))
    with commpatch.open(str(good)) as run:
        kept, kept_rows = run.to_dict(), run.rows()
    assert not ((kept_rows["phase"] == "backward") & (kept_rows["collective"] == "all_gather")).any()
    assert [a for a in kept["advice"] if a["rule"] == "fsdp_reshard"] == []
    from commpatch.analysis import engine

    if engine.available():
        from tests.test_engine_parity import assert_same_report

        pandas, _ = assert_same_report(str(poor))
        assert [a["rule"] for a in pandas["advice"]] == [a["rule"] for a in rep["advice"]]


def _train_ddp(tmp_path, port, *args):
    """examples/train_ddp.py (the demo's job) under ``commpatch run``, 2 ranks; its report as JSON."""
    out = tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "commpatch",
            "run",
            "--output",
            str(out / "rank{rank}.csv"),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=2",
            f"--master_port={port}",
            os.path.join(ROOT, "examples", "train_ddp.py"),
            *args,
        ],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    rep = subprocess.run(
        [sys.executable, "-m", "commpatch", "report", str(out), "--format", "json", "--no-progress"],
        check=True,
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
    )
    return json.loads(rep.stdout)


def test_real_demo_job_gets_no_bucket_advice_and_names_its_straggler(tmp_path):
    # the demo's default run (make demo): 1 MiB buckets, rank 1 sleeping 5 ms before each step
    data = _train_ddp(tmp_path, 35201, "--steps", "30", "--slow-rank", "1", "--slow-ms", "5")
    rules = {a["rule"]: a for a in data["advice"]}
    assert "ddp_bucket_size" not in rules
    # the straggler advice follows the report's verdict (which a machine loaded by other jobs can make
    # undecided: tests/test_stragglers.py measures it); when it names rank 1, so does the advice
    (finding,) = [f["text"] for f in data["findings"] if f["kind"] == "straggler"]
    named = "the straggler, the other ranks wait for it" in finding
    assert ("straggler" in rules) == named, finding
    assert not named or (rules["straggler"]["evidence"]["rank"] == 1 and "Rank 1 held the other ranks up" in finding), (
        finding
    )


def test_real_one_bucket_job_gets_a_smaller_cap(tmp_path):
    data = _train_ddp(tmp_path, 35202, "--steps", "30", "--bucket-mb", "1000")
    (a,) = [a for a in data["advice"] if a["rule"] == "ddp_bucket_size"]
    assert a["setting"] == {"bucket_cap_mb": 1.0} and a["evidence"]["buckets"] == 1
    assert a["evidence"]["last_bucket_params"] == 8 and "On CPU" in a["text"]  # columns the report reads
