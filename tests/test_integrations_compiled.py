"""Collectives inside compiled graphs and in functional collectives' autograd formulas, recorded
at the dispatcher (integrations/compiled.py); the profiler's gloo events as witness."""

import pytest

from tests import integration_workers as w
from tests.multiproc import run_ranks

pytestmark = pytest.mark.timeout(560)


@pytest.fixture(scope="module")
def run():
    from commpatch.integrations.compiled import formulas_unsupported

    if formulas_unsupported():  # the scenario's eager autograd formulas are not recorded there
        pytest.skip(f"the backward formulas' collectives are not recorded on {formulas_unsupported()}")
    return run_ranks(
        w.compiled_tp, 2, timeout=480
    )  # inductor compiles forward and backward: 35-55 s on 2 cores at load 10-20


def test_compiled_tensor_parallel_matches_profiler_and_eager(run):
    """ColwiseParallel / RowwiseParallel MLP under torch.compile(fullgraph=True), inductor on CPU:
    one row per collective the profiler saw, forward and backward, the compiling step included
    (its first call runs under AOT autograd's dispatch mode), with its bytes; outputs and
    gradients equal the eager model's; nothing installed before the first compile, nothing left
    after disable()."""
    for out in run:
        df, witness, witness_bytes = out["tp"]
        assert out["equal_eager"] and not out["errors"]
        assert w.claimed_counts(df) == witness == {"all_reduce": 4}  # 2 steps, the first compiles
        assert w.claimed_bytes(df) == witness_bytes
        assert df["op"].astype(str).tolist() == ["compiled.all_reduce"] * 4
        assert df["phase"].astype(str).tolist() == ["forward", "backward"] * 2
        assert set(df["source"].astype(str)) == {"compiled"} and set(df["api"].astype(str)) == {"all_reduce"}
        assert (df["timing"] == "wait").all() and (df["duration_us"] > 0).all()
        assert not out["installed_before_compile"] and not out["kernel_after_disable"]


def test_autograd_formula_collective_is_recorded(run):
    """all_gather_single_autograd: the forward by its Python wrapper (once), the reduce-scatter its
    backward formula issues from C++ by the dispatcher kernel; gloo runs the latter as an all_reduce."""
    for rank, out in enumerate(run):
        df, witness, witness_bytes, grad = out["formula"]
        assert df["op"].astype(str).tolist() == ["funcol.all_gather", "funcol.reduce_scatter"]
        assert w.claimed_counts(df) == {"all_gather": 1, "reduce_scatter": 1}
        assert dict(witness) == {"all_gather": 1, "all_reduce": 1}
        assert w.claimed_bytes(df) == witness_bytes
        assert (df["duration_us"] > 0).all()
        assert set(grad) == {2.0 * len(run) * (rank + 1)}  # the reduce-scatter summed 2s over the ranks


def test_coalesced_functional_collectives_get_their_duration():
    """A coalesced functional collective's results are waited for together where torch has
    ``wait_tensors`` (2.15: compiled code and funcol's backward formulas use it): its rows, compiled
    and eager, are timed to that wait, not left without a duration."""
    for out in run_ranks(w.compiled_coalesced, 2, timeout=240):
        assert out["equal"] and out["total"] == 2 * 4 * 2, out  # two sums of 4 ones over 2 ranks
        ops = [op for op, _ in out["rows"]]
        assert ops == ["compiled.all_reduce_coalesced"] * 3 + ["funcol.all_reduce_coalesced"], out["rows"]
        assert all(d > 0 for _, d in out["rows"]), out["rows"]  # NaN (never waited) fails too
