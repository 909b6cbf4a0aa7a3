"""Module attribution on a DDP model: a submodule's forward collective, DDP's backward buckets,
an optimizer step's collective and a barrier outside all of them, and
``commpatch.summary(by=("module", "phase"))`` over those rows; the profiler as witness."""

from collections import Counter

import pytest

from tests import integration_workers as w
from tests.multiproc import run_ranks

DDP = "DistributedDataParallel"


@pytest.fixture(scope="module")
def run():
    return run_ranks(w.module_attribution, 2, timeout=90)


def test_rows_name_module_and_phase(run):
    for df, witness, _, errors in run:
        assert not errors
        assert w.claimed_counts(df) == witness
        got = Counter(zip(df["op"].astype(str), df["module"].astype(str), df["phase"].astype(str)))
        assert got == {
            ("ddp_verify_params", "", "other"): 1, ("ddp_broadcast_coalesced", "", "other"): 1,
            ("all_reduce", "module.0", "forward"): 2,         # the submodule's own forward (FQN under DDP)
            ("ddp_rebuild_buckets", DDP, "forward"): 1,       # before the 2nd forward
            ("ddp_bucket_allreduce", DDP, "backward"): 2,
            ("all_reduce", "ClipSGD", "optimizer"): 2,        # named by the optimizer's class
            ("barrier", "", "other"): 1,
        }


def test_summary_by_module_and_phase(run):
    for df, _, summary, _ in run:
        keyed = {(r.module, r.phase): r for r in summary.itertuples()}
        assert set(keyed) == {("", "other"), ("module.0", "forward"), (DDP, "forward"), (DDP, "backward"),
                              ("ClipSGD", "optimizer")}
        for (module, phase), r in keyed.items():
            rows = df[(df["module"] == module) & (df["phase"] == phase)]
            assert r.count == len(rows) and r.bytes == rows["bytes"].sum()
        assert keyed[("module.0", "forward")].bytes == 2 * 8 * 4       # an 8-float statistic per step
        assert keyed[("ClipSGD", "optimizer")].bytes == 2 * 4
        assert keyed[(DDP, "backward")].bytes == 2 * (8 * 8 + 8 + 8 * 4 + 4) * 4   # every parameter per step
        assert summary["time_share"].sum() == pytest.approx(1.0)
