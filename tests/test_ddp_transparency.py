"""DDP under commpatch behaves as DDP without it: bit-identical gradients for every DDP option
(join with both divisors, static graph, gradient_as_bucket_view, no_sync, unused parameters,
sparse gradients), comm hooks registered after the first step (and after disable()), the same
errors, the same ``_get_ddp_logging_data()`` (``comm_hook`` included), and bucket rows still
recorded.

One run of 4 gloo ranks (tests/ddp_transparency_workers.py): each case without and with
commpatch in the same ranks, most on a group of 3 ranks (1/3 is inexact, so the divisor and
the operation, x * (1/3) or x / 3, both show), a few on all 4.
"""

import pytest

from tests import ddp_transparency_workers as w
from tests.multiproc import run_ranks

# cases whose gradients come from the reducer's own arithmetic, reproduced by commpatch's hook
DEFAULT_HOOK = (
    "default",
    "join_initial",
    "join_running",
    "static_graph",
    "bucket_view",
    "bucket_view_kept",
    "bucket_view_mixed",
    "bucket_view_join",
    "no_sync",
    "find_unused",
    "find_unused_view_accum",
    "sparse",
)
USER_HOOK = (
    "user_hook_early",
    "user_hook_late",
    "builtin_allreduce_late",
    "builtin_fp16_late",
    "builtin_fp16_early",
    "registered_twice",
    "late_after_disable",
)
# on all 4 ranks (the default group): with a power of two, a divisor of 3 appears only once a rank
# joins; _register_fused_optim's hook always reduces over the default group
FOUR_RANKS = ("bucket_view_join", "join_running", "fused_optimizer_late")
# not available on a CPU-only torch 2.13 (events, accelerator streams): the same error with and
# without commpatch (and identical gradients should they run)
CPU_UNAVAILABLE = ("mixed_precision", "optimizer_in_backward")


@pytest.fixture(scope="module")
def runs():
    """Per rank: {case: outcome} for ranks 0-2, {case@4: outcome} for all four ranks."""
    return run_ranks(
        w.transparency,
        4,
        timeout=150,
        pg_timeout=60,  # < the 180 s pytest timeout
        cases=DEFAULT_HOOK + USER_HOOK + CPU_UNAVAILABLE,
        four_rank_cases=FOUR_RANKS,
    )


@pytest.fixture(scope="module")
def three(runs):
    return runs[:3]


def _check(results, names):
    for rank, res in enumerate(results):
        assert res["_internal_errors"] == {}, f"rank {rank}: {res['_internal_errors']}"
        for name in names:
            out = res[name]
            assert "error" not in out, f"rank {rank} {name}:\n{out.get('error')}"
            assert out["identical"], f"rank {rank} {name}: gradients differ from plain DDP"
            assert out["raised"][0] == out["raised"][1], f"rank {rank} {name}: {out['raised']}"
            assert out["logging_diff"] == {}, f"rank {rank} {name}: {out['logging_diff']}"
            yield rank, name, out


def test_gradients_bit_identical_under_every_ddp_option(three):
    for rank, name, out in _check(three, DEFAULT_HOOK):
        assert out["raised"] == (None, None) and out["steps"] >= 1
        assert out["bucket_rows"] > 0, f"rank {rank} {name}: no bucket recorded"
        assert out["comm_hook"] == (None, None)  # no comm_hook entry, as without commpatch


def test_join_uneven_inputs_steps(three):
    for rank, res in enumerate(three):
        for name in ("join_initial", "join_running", "bucket_view_join"):
            assert res[name]["steps"] == 1 + rank  # ranks joined one after another


def test_hooks_registered_early_late_and_after_disable(three):
    for rank, name, out in _check(three, USER_HOOK):
        assert out["raised"] == (None, None) and out["steps"] == w.STEPS
        assert out["comm_hook"][0] is not None and out["comm_hook"][0] == out["comm_hook"][1]
        assert out["hook_rows"] > 0, f"rank {rank} {name}: no bucket recorded"
    for res in three:
        assert res["builtin_allreduce_late"]["comm_hook"][1] == "BuiltinCommHookType.ALLREDUCE"
        assert res["builtin_fp16_early"]["comm_hook"][1] == "BuiltinCommHookType.FP16_COMPRESS"
        assert res["user_hook_late"]["comm_hook"][1] == "allreduce_hook"


def test_second_registration_fails_as_without_commpatch(three):
    for res in three:
        plain, patched = res["registered_twice"]["raised_twice"]
        assert plain is not None and "can only be called once" in plain
        assert patched == plain


def test_mixed_precision_and_optimizer_in_backward_same_outcome(three):
    for _ in _check(three, CPU_UNAVAILABLE):
        pass


def test_four_ranks_join_with_bucket_views_and_fused_optimizer(runs):
    """gradient_as_bucket_view, join(divide_by_initial_world_size=False), 4 ranks: the divisor
    becomes 3 once a rank joins, and the hook must then know which gradients are bucket views."""
    for rank, name, out in _check(runs, [f"{name}@4" for name in FOUR_RANKS]):
        assert out["raised"] == (None, None)
        if name.startswith("fused"):
            assert out["steps"] == w.STEPS and out["hook_rows"] > 0
            assert out["comm_hook"][0] == out["comm_hook"][1] is not None
        else:
            assert out["steps"] == 1 + rank and out["bucket_rows"] > 0
