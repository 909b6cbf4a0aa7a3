"""Every wrapped op records exactly one row with the right op, bytes, dtype, peer and group
size, on real gloo process groups of 2 and 4 ranks."""

import math

import pytest

from commpatch.data.ops import TARGET_NAMES
from tests import workers
from tests.multiproc import run_ranks


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ops_run(request):
    return request.param, run_ranks(workers.all_ops, request.param, timeout=150)


def _scenario_names():
    return [
        "all_reduce",
        "all_reduce_async",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "_all_gather_base",
        "all_gather_coalesced",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "gather_single",
        "gather_into_tensor",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "barrier",
        "monitored_barrier",
        "send_recv",
        "isend_irecv",
        "batch_isend_irecv",
        "object_p2p",
    ]


def test_scenarios_cover_every_target():
    import torch.distributed as dist

    covered = {op for op in TARGET_NAMES if any(op in s or s.startswith(op) for s in _scenario_names())}
    covered |= {"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"}
    missing = [op for op in TARGET_NAMES if hasattr(dist, op) and op not in covered]
    assert not missing, f"ops without a scenario: {missing}"


# public functions of torch.distributed that issue no collective (set-up, queries, helpers): every
# other one must be in the table (a collective a newer torch adds is caught here, not by a user)
NOT_COLLECTIVES = {
    "breakpoint",
    "destroy_process_group",
    "get_backend",
    "get_backend_config",
    "get_backend_impl",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_device_mesh",
    "init_process_group",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "record_comm",  # a context manager naming the collectives inside it for the profiler
    "register_rendezvous_handler",
    "rendezvous",
    "set_timeout",
    "shrink_group",
    "split_group",
    "supports_complex",
}


def test_every_public_function_of_this_torch_is_wrapped_or_known_not_to_communicate():
    import inspect
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dist.reduce_op is deprecated
        public = {n for n in dir(dist) if not n.startswith("_") and inspect.isfunction(getattr(dist, n))}
    unknown = sorted(public - set(TARGET_NAMES) - NOT_COLLECTIVES)
    assert not unknown, f"torch.distributed functions neither wrapped nor known to issue no collective: {unknown}"


@pytest.mark.parametrize("scenario", _scenario_names())
def test_one_row_per_call(ops_run, scenario):
    import torch

    world, results = ops_run
    for rank, per_rank in enumerate(results):
        df, exp, error = per_rank[scenario]
        if not exp["present"]:
            pytest.skip(f"torch {torch.__version__} has no torch.distributed.{exp['op']}")
        if error is not None and "does not support" in error:
            # gloo in this torch lacks the op (reduce_scatter, all_to_all before 2.6): the user's
            # error surfaced unchanged (caught in the worker), recorded once as what was called
            assert exp["participates"] and len(df) == 1, f"rank {rank}: {error}: {len(df)} rows"
            assert df.iloc[0]["op"] == exp["op"] and df.iloc[0]["status"] == "error"
            continue
        assert error is None, f"rank {rank}: {error}"
        if not exp["participates"]:
            assert len(df) == 0, f"rank {rank} should record nothing"
            continue
        assert len(df) == 1, f"rank {rank}: {len(df)} rows: {df[['op', 'bytes']].to_dict('records')}"
        row = df.iloc[0]
        assert row["op"] == exp["op"]
        assert row["dtype"] == exp["dtype"]
        assert row["group_size"] == world and row["world_size"] == world and row["rank"] == rank
        assert row["group_ranks"] == (f"0-{world - 1}" if world > 2 else "0 1")  # range notation
        assert row["backend"] == "gloo" and row["status"] == "ok"
        assert row["peer"] == exp["peer"]
        if exp["bytes"] is None:  # object collectives: bytes of the tensors they moved
            assert row["bytes"] > 0 and row["numel"] == row["bytes"]
        else:
            assert row["bytes"] == exp["bytes"]
        assert row["host_us"] > 0 and row["start_ns"] > 1.6e18
        if row["timing"] in ("host", "future", "wait"):
            assert row["duration_us"] > 0
        else:
            assert row["timing"] == "none" and math.isnan(row["duration_us"])


def test_async_durations_cover_completion(ops_run):
    _, results = ops_run
    for per_rank in results:
        df, _, _ = per_rank["all_reduce_async"]
        row = df.iloc[0]
        assert row["async_op"] and row["timing"] == "future"
        assert row["duration_us"] > 0


def test_gloo_p2p_without_future_is_timed_at_its_wait(ops_run):
    """gloo's isend/irecv works have no future: they are timed to the return of the thread's
    ``Work.wait()`` on them (timing ``wait``), and the time the thread spent in that wait is the row's
    ``wait_us`` (they had no duration: a pipeline's exposed time and stages were unknown)."""
    _, results = ops_run
    for rank in (0, 1):
        row = results[rank]["isend_irecv"][0].iloc[0]
        assert row["timing"] == "wait" and row["duration_us"] > 0, row
        assert 0 <= row["wait_us"] <= row["duration_us"], row
    df, _, _ = results[0]["batch_isend_irecv"]  # one row for the works of a batch: none is invented
    assert df.iloc[0]["timing"] == "none" and math.isnan(df.iloc[0]["duration_us"])
    df, _, _ = results[0]["send_recv"]  # the synchronous form is timed on the host
    assert df.iloc[0]["timing"] == "host" and df.iloc[0]["duration_us"] > 0


def test_group_seq_matches_across_ranks(ops_run):
    _, results = ops_run
    for name in ("all_reduce", "broadcast", "all_gather_object"):
        seqs = {per_rank[name][0].iloc[0]["group_seq"] for per_rank in results}
        assert len(seqs) == 1, f"{name}: group_seq differs across ranks: {seqs}"


def test_works_never_waited_for_stay_bounded():
    """A job that drops its gloo isend / irecv works without waiting: at most ``AT_WAIT_MAX`` are kept
    for their wait (each keeps its tensor alive), the others' rows stay untimed; a work waited for
    after that is still timed, its wait noted."""
    from commpatch.data.schema import T_WAIT
    from commpatch.record.log import Log
    from commpatch.record.timing import AT_WAIT_MAX, Timing

    class Work:  # what Timing keeps of a work: the object, by identity
        pass

    timing, op = Timing(Log()), 7
    timing.no_future.add(op)  # as gloo's send / recv, whose get_future() raises
    for seq in range(3 * AT_WAIT_MAX):
        assert timing.future(seq, 0, Work(), op) == T_WAIT
        assert len(timing.at_wait) <= AT_WAIT_MAX
    work = Work()
    timing.future(10**6, 5, work, op)
    timing.waited(work, 10)
    assert timing.log.done[10**6] > 0 and timing.log.waits[-1][0] == 10**6 and not timing.at_wait.get(id(work))
