"""Device-event timing on CPU, proved with an emulated accelerator ("emu", PrivateUse1).

tests/emulated_device/ builds a small C++ extension (cached in ~/.cache/commpatch-emudev or
$COMMPATCH_EMUDEV_CACHE) whose streams run work asynchronously on worker threads and whose events
are stamped when a stream reaches them, plus a stream-ordered process group ("emustream") used as
``init_process_group("cpu:gloo,emu:emustream")``. Every device test runs in spawned processes,
so the extension (which renames PrivateUse1 process-wide) never loads into pytest's own process.
"""

import math
import os
import subprocess
import sys
import time

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from tests import emulated_device as emu  # noqa: E402  (imports neither torch nor the extension)
from tests.emulated_device import workers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY_MS = 150
MIN_MS = 140  # device-side lower bound for a 150 ms stall
HOST_MAX_MS = 10  # a host call that queues device work must return well under this


@pytest.fixture(scope="module")
def built():
    """Build the extension once, in a child process (cold: ~30 s; cached: well under 1 s)."""
    reason = emu.missing_toolchain() or emu.unsupported_torch()
    if reason:
        pytest.skip(reason)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from tests import emulated_device as e; e.load(); print(f'{e.build_seconds:.2f}')"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    if proc.returncode != 0:
        pytest.fail(f"building the emulated device failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return {"load_seconds": float(proc.stdout.strip().splitlines()[-1]), "wall_seconds": time.perf_counter() - t0}


@pytest.fixture(scope="module")
def device(built):
    return workers.run_emu_ranks(workers.device_checks, 1, timeout=60)[0]


# ------------------------------------------------------------------ the device itself
def test_generic_accelerator_apis_see_the_device(device):
    assert device["accelerator"] == (True, "emu", 1)
    assert device["stream_type"] == "Stream"
    assert device["errors"] == []


def test_events_time_device_work_while_the_host_returns_at_once(device):
    assert device["host_ms"] < HOST_MAX_MS
    assert device["query_while_busy"] is False
    assert device["query_after_sync"] is True
    assert MIN_MS <= device["elapsed_ms"] < BUSY_MS + 100


def test_elapsed_time_raises_unless_both_events_timed_and_completed(device):
    assert "completed" in device["elapsed_before_done"]
    assert "enable_timing" in device["elapsed_untimed"]


def test_host_wait_counter_stays_zero_until_someone_synchronizes(device):
    assert device["waits_before_sync"] == 0
    assert device["waits_after_sync"] == {
        "stream_synchronize": 0,
        "event_synchronize": 1,
        "device_synchronize": 0,
        "op_wait": 0,
    }
    assert device["waits_stream_device"] == {
        "stream_synchronize": 1,
        "event_synchronize": 0,
        "device_synchronize": 1,
        "op_wait": 0,
    }


def test_a_stream_waits_for_another_streams_event(device):
    assert device["side_id"] != 0
    assert device["wait_event_ms"] >= 90  # the 100 ms sleep ran on the side stream
    assert device["stream_sync_ms"] >= 90


def test_aten_ops_run_after_the_work_queued_on_the_stream(device):
    assert device["op_after_job"] == [8.0] * 4  # the queued job's fill (7) happened first
    assert device["op_waits"] == 1
    assert device["matmul_ok"]


def test_capture_switch_drives_stream_is_capturing(device):
    assert device["capturing"] == [False, True, False]


# ------------------------------------------------------------------ collectives on the device
@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def collectives(request, built):
    return request.param, workers.run_emu_ranks(workers.collectives, request.param, timeout=90)


def test_a_busy_rank_stretches_its_peers_device_side_collective(collectives):
    world_size, results = collectives
    for rank, r in enumerate(r["timing"] for r in results):
        assert r["correct"], rank
        assert r["errors"] == [], rank
        assert r["host_call_ms"] < HOST_MAX_MS, (rank, r)
        assert r["host_wait_ms"] < HOST_MAX_MS, (rank, r)  # work.wait(): the stream waits, not the host
        assert r["waits_before_sync"] == 0, (rank, r)
        # then(): the callback runs on another stream, made to wait for the collective (within the
        # microseconds between the collective's end and the `end` event recorded after it)
        assert r["cb_ms_from_start"] >= r["device_ms"] - 1.0, (rank, r)
        if rank == 0:
            assert r["device_ms"] < MIN_MS / 2, r  # the busy rank arrives last: no waiting
        else:
            assert r["device_ms"] >= MIN_MS, (rank, r)
            assert r["cb_ms_from_start"] >= MIN_MS, (rank, r)


def test_every_collective_is_correct_on_the_device(collectives):
    world_size, results = collectives
    for rank, r in enumerate(r["coverage"] for r in results):
        assert r.pop("errors") == [], rank
        assert all(r.values()), (rank, r)
        assert set(r) >= {
            "all_reduce",
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "barrier",
            "send_recv",
            "cpu_all_reduce",
        }


def test_ddp_on_the_device_matches_cpu_exactly(built):
    for r in workers.run_emu_ranks(workers.ddp_train, 2, timeout=90):
        assert r["errors"] == []
        assert r["emu_losses"] == r["cpu_losses"]
        assert r["identical"], r["max_abs_diff"]
        assert r["ranks_agree"]


# ------------------------------------------------------------------ commpatch on the device
def _collective_rows(rows):
    return [r for r in rows if r["op"] == "all_reduce"]


def test_commpatch_times_collectives_on_the_device_without_host_waits(collectives):
    world_size, results = collectives
    for rank, r in enumerate(r["commpatch"] for r in results):
        assert r["errors"] == [], rank
        assert r["sync_host_ms"] < HOST_MAX_MS and r["async_host_ms"] < HOST_MAX_MS, (rank, r)
        assert r["waits_in_calls"] == {
            "stream_synchronize": 0,
            "event_synchronize": 0,
            "device_synchronize": 0,
            "op_wait": 0,
        }, "the host waited before the log was read"
        rows = _collective_rows(r["rows"])
        assert [(x["async_op"], x["device"], x["backend"], x["timing"]) for x in rows] == [
            (False, "emu", "emustream", "device_event")
        ] + [(True, "emu", "emustream", "device_event")] * 3
        sync = rows[0]["duration_us"] / 1e3
        if rank == 0:
            assert sync < MIN_MS / 2, r  # the busy rank arrives last: no waiting
        else:
            assert sync >= MIN_MS, (rank, rows[0])  # waited for rank 0 on the device
        barrier = [x for x in r["rows"] if x["op"] == "barrier"]
        assert barrier[0]["device"] == "none" and barrier[0]["backend"] == "gloo"


def test_own_time_excludes_the_wait_behind_an_earlier_collective(collectives):
    """On a group with a stream of its own (as NCCL's), a small all_reduce issued right after a
    long one starts at once on the caller's stream but completes after the long one: duration_us
    counts the queue, own_us does not."""
    world_size, results = collectives
    for rank, r in enumerate(r["commpatch"] for r in results):
        long, small = _collective_rows(r["rows"])[2:]
        assert small["own_us"] <= small["duration_us"]
        if rank > 0:
            assert long["duration_us"] / 1e3 >= MIN_MS and long["own_us"] == long["duration_us"], (rank, long)
            assert small["duration_us"] / 1e3 >= MIN_MS, (rank, small)  # queued behind the long one
            assert small["own_us"] / 1e3 < MIN_MS / 2, (rank, small)  # its own time is short


def test_no_event_is_touched_while_the_stream_is_capturing(collectives):
    world_size, results = collectives
    for rank, r in enumerate(r["commpatch"] for r in results):
        assert r["capture"] == {"created": 0, "pending": 0, "waits": 0}, rank
        before, *captured = r["capture_rows"]
        assert before["timing"] == "device_event" and before["duration_us"] > 0  # resolved after the capture
        assert [(x["timing"], x["device"]) for x in captured] == [("none", "emu")] * 2


def test_the_event_pool_does_not_grow(collectives):
    world_size, results = collectives
    for rank, r in enumerate(r["commpatch"] for r in results):
        halfway, at_the_end = r["pool"]
        # events exist for what is in flight between two reads of the user's, not for the calls
        # made: a resolve leaves at most the 100 calls since the last read in flight, the next one
        # comes when twice that many are (resolve_at doubles past what a resolve left, so resolving
        # stays cheap while the device is behind), each with 2 events, plus each group's last end
        assert at_the_end <= 2 * (2 * 100) + 8, (rank, r["pool"])
        # flat over the second half of the calls: new events only for measurements in flight beyond the
        # most so far (2 each: the device fell further behind, a loaded machine's worker threads
        # starved), never for the calls made (+12 in a matrix run whose peak had risen)
        rise = r["peak_in_flight"][1] - r["peak_in_flight"][0]
        assert at_the_end - halfway <= 2 * rise + 8, (rank, r["pool"], r["peak_in_flight"])
        # two events per measurement at the most in flight at once (each group's last end among them)
        for made, peak in zip(r["pool"], r["peak_in_flight"]):
            assert made <= 2 * peak + 8, (rank, r["pool"], r["peak_in_flight"])
        # and none is lost: once the log is read, every event created is back in the pool or kept
        # as a group's last end (a leak of one event per thousand calls fails this)
        assert r["events_accounted"] == r["events_created"], (rank, r)
        assert r["pool_rows"] == (10_000 if world_size == 2 else 1_000)


def test_ddp_fsdp2_and_nccl_timing_on_the_device(built):
    for rank, r in enumerate(workers.run_emu_ranks(workers.commpatch_frameworks, 2, timeout=120)):
        assert r["errors"] == [], rank
        assert r["ddp_rows"] and {(x["op"], x["device"], x["backend"], x["timing"]) for x in r["ddp_rows"]} == {
            ("ddp_bucket_allreduce", "emu", "emustream", "device_event")
        }, r["ddp_rows"]
        assert all(x["duration_us"] > 0 for x in r["ddp_rows"])
        internal = r["ddp_internal_rows"]  # the constructor's check and broadcast, the bucket rebuild
        assert {x["op"] for x in internal} >= {"ddp_verify_params_allgather", "ddp_broadcast_coalesced"}, internal
        assert {(x["device"], x["timing"]) for x in internal} == {("emu", "device_event")}, internal
        assert "fsdp_error" not in r, r.get("fsdp_error")
        assert {x["op"] for x in r["fsdp_rows"]} == {"all_gather_single", "reduce_scatter_single"}
        assert {(x["device"], x["timing"]) for x in r["fsdp_rows"]} == {("emu", "device_event")}
        assert all(x["duration_us"] > 0 for x in r["fsdp_rows"])
        nccl = r["nccl"]
        assert nccl["code_is_nccl"] and nccl["pending_before"] == 1 and nccl["pending_after"] == 0
        assert 38 <= nccl["duration_ms"] < 60, nccl  # the 40 ms "kernel", not the 20 ms queued before it


def _late_rank_1(monkeypatch, worker, late_ms: int) -> list:
    """``worker`` on 2 ranks, 4 steps, rank 1's device busy ``late_ms`` before each, the group on a
    stream of its own (as NCCL's): each rank's result, with no error on either."""
    monkeypatch.setenv("EMUSTREAM_COMM_STREAM", "1")
    results = workers.run_emu_ranks(worker, 2, timeout=120, late_ms=late_ms, steps=4)
    for rank, r in enumerate(results):
        assert r["errors"] == [], rank
    return results


def test_fsdp2_stall_at_its_all_gather_is_timed_on_the_device(built, monkeypatch):
    """FSDP2 on an accelerator: its copy-out makes the stream wait for the all-gather's event and the
    host returns at once, so the all-gather rows' waits were unknown (the step's exposed time said 0,
    its communication all "overlap unknown") while rank 0's stream stalled ~60 ms per step for rank
    1's late all-gather. The stall is now timed on the device, between events around that wait: the
    all-gather rows' waits, and the step's exposed time."""
    late_ms = 60
    for rank, r in enumerate(_late_rank_1(monkeypatch, workers.fsdp2_device_stall, late_ms)):
        rows = r["rows"]
        assert rows and {(x["device"], x["timing"]) for x in rows} == {("emu", "device_event")}, rows
        assert not any(math.isnan(x["wait_us"]) for x in rows), rows  # each all-gather's stall is known
        steady = [x for x in rows if x["step"] >= 1]  # step 0: the group's first calls (connections, streams)
        waits: dict = {}
        for x in steady:
            assert x["wait_us"] >= 0, (rank, x)
            waits.setdefault(x["step"], []).append(x["wait_us"])
        exposed = {s["step"]: s["exposed_us"] for s in r["steps"]}
        for step, wait in waits.items():
            if rank == 0:  # its stream waited for rank 1's late all-gather once a step
                assert late_ms * 0.8 <= sum(wait) / 1e3 <= late_ms * 1.5, (rank, step, steady)
            else:  # rank 1 was the late one: its stream found the gathered parameters ready
                assert sum(wait) / 1e3 < late_ms * 0.25, (rank, step, steady)
            # the stalls are the step's exposed time: the union of their windows, each placed before
            # its row's completion (which the host's issue + the device duration place; two may overlap)
            assert max(wait) * 0.99 <= exposed[step] <= sum(wait) * 1.01, (rank, step, exposed, wait)


def test_an_async_calls_work_wait_stall_is_timed_on_the_device(built, monkeypatch):
    """A user's ``async_op=True`` call on an accelerator: ``Work.wait()`` makes the current stream
    wait (the host returns at once), so its rows' waits were unknown ("overlap unknown") while rank
    0's stream stalled ~60 ms per step in the wait for rank 1's late all-reduce. The stall is now
    timed on the device between events around the wait (the work noted weakly: a work dropped
    unwaited leaves nothing behind)."""
    late_ms = 60
    for rank, r in enumerate(_late_rank_1(monkeypatch, workers.async_work_device_wait, late_ms)):
        rows = r["rows"]
        assert len(rows) == 6 and {(x["op"], x["async_op"], x["device"], x["timing"]) for x in rows} == {
            ("all_reduce", True, "emu", "device_event")
        }, rows
        *rows, dropped, twice = rows
        assert math.isnan(dropped["wait_us"]) and r["noted_after_drop"] == 0, (dropped, r)
        assert twice["wait_us"] >= 0, twice  # waited twice: the first wait's stall, once
        exposed = {s["step"]: s["exposed_us"] for s in r["steps"]}
        for x in rows[1:]:  # step 0: the group's first call (connections, streams)
            if rank == 0:  # its stream waited for rank 1's late all-reduce at each wait
                assert late_ms * 0.8 <= x["wait_us"] / 1e3 <= late_ms * 1.5, (rank, x)
            else:  # rank 1 was the late one: its stream found the result ready
                assert x["wait_us"] / 1e3 < late_ms * 0.25, (rank, x)
            assert exposed[x["step"]] == pytest.approx(x["wait_us"]), (rank, x, exposed)


def test_resolving_stays_linear_while_the_device_is_far_behind(built):
    """2,000 calls issued while the device is 3 s behind the host: every measurement stays in flight.
    Resolving early (to give events back to the pool) walked every one of them for each new event,
    ~n^2 / 2 = 2,000,000 items, the host slowing down the further the device fell behind (an H100 run
    found it). Measurements now wait in per-group chains in seq order and a resolve queries each
    chain's head only: each measurement is taken in once and queried about once when it completes,
    plus one query of a head per resolve (when the pool is empty, at twice what the last one left)."""
    r = workers.run_emu_ranks(workers.commpatch_behind, 1, timeout=120)[0]
    assert r["in_flight_after_issue"] >= 1900, r  # the device really was behind: nothing resolved
    assert r["examined_while_behind"] <= 2000 + 2000 // 64 * 2 + 16, r
    assert r["examined"] <= 2 * 2000 + 2000 // 64 * 2 + 16, r
    assert r["rows"] == r["timed"] == 2000, r  # and every row got its duration once it caught up


def test_functional_collectives_stall_is_timed_on_the_device(built, monkeypatch):
    """Tensor parallel's collectives on an accelerator: ``wait_tensor`` only makes the stream wait,
    the host returns at once. Timed on the host (as on CPU), rank 0's rows said it waited 0.04-0.15
    ms per step (its exposed time ~0) while its stream stalled 60 ms per step for rank 1, and their
    durations were the host's issue-to-wait. Now timed on the device: from the issue to the stream
    passing the wait, the wait the stream's stall there; eagerly (``funcol``) and through the ops
    compiled graphs call (the kernels of ``integrations.compiled``)."""
    late_ms = 60
    for rank, r in enumerate(_late_rank_1(monkeypatch, workers.funcol_device_wait, late_ms)):
        rows = r["rows"]
        assert [x["op"] for x in rows] == ["funcol.all_reduce"] * 4 + ["compiled.all_reduce"] * 4 + [
            "funcol.all_reduce"
        ]
        *rows, captured = rows  # the last one issued and waited for while the stream was capturing
        assert {(x["device"], x["timing"]) for x in rows} == {("emu", "device_event")}, rows
        assert captured["timing"] == "none" and math.isnan(captured["duration_us"]), captured
        assert math.isnan(captured["wait_us"]) and r["captured_in_flight"] == 0, (captured, r)
        steady = [x for x in rows if x["step"] >= 2]  # steps 0-1: the group's first calls (connections, streams)
        for x in steady:
            assert x["duration_us"] >= x["wait_us"] >= 0, (rank, x)
            if rank == 0:  # its stream waited for rank 1's late collective at each wait
                assert late_ms * 0.8 <= x["wait_us"] / 1e3 <= late_ms * 1.5, (rank, x)
            else:  # rank 1 was the late one: its stream found the result ready
                assert x["wait_us"] / 1e3 < late_ms * 0.25, (rank, x)
        exposed = {s["step"]: s["exposed_us"] for s in r["steps"]}
        waits = {x["step"]: x["wait_us"] for x in steady}
        for step, wait in waits.items():  # the step's exposed time is that stall, not an unknown
            assert exposed[step] == pytest.approx(wait), (rank, step)
