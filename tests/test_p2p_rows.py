"""Point-to-point rows (issue 23): ``batch_isend_irecv`` rows name their peer, and object p2p
rows count the bytes moved once; real gloo ranks (2 and 4), torch.profiler as witness."""

import pytest

from tests import runtime_workers as w
from tests.multiproc import run_ranks


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def p2p_run(request):
    return request.param, run_ranks(w.p2p, request.param, timeout=120)


def test_batch_isend_irecv_rows_name_their_peer(p2p_run):
    """The global rank every op of the batch exchanges with; -1 when they name several (a ring
    of 4: send to the next rank, receive from the previous one)."""
    _, results = p2p_run
    for rank, r in enumerate(results):
        batches = [(nbytes, peer) for op, nbytes, peer in r["rows"] if op == "batch_isend_irecv"]
        assert batches == [(32, r["expected_peers"][0]), (32, r["expected_peers"][1])], rank


def test_object_p2p_bytes_are_the_bytes_moved(p2p_run):
    """send_object_list sends the size tensor and the pickled object: each once (``send`` calls
    ``isend``: both were counted, twice the bytes moved)."""
    _, results = p2p_run
    for rank, r in enumerate(results):
        objects = [(op, peer) for op, _, peer in r["rows"] if op.endswith("_object_list")]
        assert objects == ([("send_object_list", 1)] if rank == 0 else [("recv_object_list", 0)] if rank == 1 else [])
        assert sum(nbytes for _, nbytes, _ in r["rows"]) == r["witness"], (rank, r["rows"])
