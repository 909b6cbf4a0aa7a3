"""torch.distributed.pipelining: a GPipe schedule runs while patched; p2p rows carry the peer."""

from tests import integration_workers as w
from tests.multiproc import run_ranks


def test_gpipe_schedule_p2p_rows_match_profiler():
    for rank, (df, witness) in enumerate(run_ranks(w.pipeline, 2, timeout=120)):
        p2p = df[df["op"].isin(["isend", "irecv", "batch_isend_irecv"])]
        assert len(p2p) > 0
        peers = set(p2p.loc[p2p["op"] != "batch_isend_irecv", "peer"])
        assert peers <= {1 - rank}
        assert w.claimed_counts(df) == witness        # send_object_list = 2 sends, etc.
