"""Activation checkpointing (issue 23): a recomputation that reuses saved collective outputs
issues no collective, and commpatch records none. Two real gloo ranks, torch.profiler as witness."""

import pytest

from tests import runtime_workers as w
from tests.multiproc import run_ranks


@pytest.fixture(scope="module")
def sac():
    return run_ranks(w.selective_checkpoint, 2, timeout=120)


def test_selective_checkpoint_records_only_the_collectives_that_ran(sac):
    """Per step and layer: forward all-gather and reduce-scatter, their backward formulas'
    all-gather and reduce-scatter (not the first layer's: its input needs no gradient); the
    recomputation gets the forward outputs from SAC's cache (they used to be recorded again)."""
    for rank, r in enumerate(sac):
        assert r["identical"], rank
        assert not r["errors"], r["errors"]
        gathers, scatters = w.STEPS * 4, w.STEPS * 3
        assert r["ops"] == {"funcol.all_gather": gathers, "funcol.reduce_scatter": scatters}
        claimed, witness = r["counts"]
        assert claimed == witness == {"all_gather": gathers, "all_reduce": scatters}   # gloo: reduce-scatter as all-reduce
        claimed, witness = r["bytes"]
        assert claimed == witness
