"""torch.distributed.pipelining: a GPipe schedule runs while patched; p2p rows carry the peer."""

from collections import Counter

from tests import integration_workers as w
from tests.multiproc import run_ranks


def test_gpipe_schedule_p2p_rows_match_profiler():
    for rank, (df, witness, witness_bytes) in enumerate(run_ranks(w.pipeline, 2, timeout=120)):
        p2p = df[df["op"].isin(["isend", "irecv", "batch_isend_irecv"])]
        assert len(p2p) > 0
        peers = set(p2p.loc[p2p["op"] != "batch_isend_irecv", "peer"])
        assert peers <= {1 - rank}
        batched = df["op"] == "batch_isend_irecv"  # the schedule of torch 2.4 sends in batches
        if not batched.any():
            assert w.claimed_counts(df) == witness  # send_object_list = 2 sends, etc.
            continue
        # a batch row does not say which of its ops were sends: the p2p rows' bytes, with those of
        # the object lists (newer schedules exchange their shapes so: sends and receives to the
        # profiler), are what the profiler's sends and receives moved; every other row is claimed
        # one for one
        is_p2p = df["op"].isin(["isend", "irecv", "batch_isend_irecv"])
        objects = df["op"].isin(["send_object_list", "recv_object_list"])
        moved = int(df.loc[is_p2p | objects, "bytes"].sum())
        assert moved == witness_bytes["send"] + witness_bytes["recv"]
        others = Counter({op: n for op, n in witness.items() if op not in ("send", "recv")})
        assert w.claimed_counts(df[~is_p2p & ~objects]) == others
