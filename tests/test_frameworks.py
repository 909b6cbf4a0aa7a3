"""Real frameworks on tiny models built from config (issue 23), 2 gloo ranks on CPU: results
bit-identical with and without commpatch, and commpatch's counts and bytes per collective equal
to torch.profiler's ``gloo:`` events on the same run. Skipped when the framework is absent
(``pip install transformers accelerate lightning``; each run takes ~30 s on 2 cores)."""

import pytest

from tests import framework_workers as fw
from tests.multiproc import run_ranks

# real frameworks (HF Trainer, Accelerate, Lightning) as witnesses: minutes of jobs, `make test-slow`
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _check(results):
    for rank, r in enumerate(results):
        assert r["identical"], f"rank {rank}: not bit-identical to the run without commpatch"
        assert not r["errors"], r["errors"]
        for what in ("counts", "bytes"):
            claimed, witness = r[what]
            assert claimed == witness, f"rank {rank}, {what} per collective: commpatch {claimed}, profiler {witness}"
    return results


def test_hugging_face_trainer(tmp_path):
    """GPT-2 (2 layers, from GPT2Config), Trainer with DDP over gloo, gradient accumulation 2:
    the DDP constructor's collectives, a bucket all-reduce and the unused-parameter bitmap
    all-reduce per optimizer step (the Trainer's find_unused_parameters)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    for r in _check(run_ranks(fw.hf_trainer, 2, timeout=360, out_dir=str(tmp_path))):
        assert r["ops"]["ddp_bucket_allreduce"] == fw.STEPS and r["ops"]["ddp_unused_allreduce"] == fw.STEPS


def test_lightning(tmp_path):
    """A transformer encoder layer in a LightningModule, Lightning's DDP strategy over gloo (the
    ranks launched outside Lightning, as torchrun does): its barriers and object broadcast too."""
    pytest.importorskip("lightning")
    for r in _check(run_ranks(fw.lightning, 2, timeout=360, out_dir=str(tmp_path))):
        assert r["ops"]["ddp_bucket_allreduce"] == fw.STEPS
