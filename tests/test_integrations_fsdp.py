"""FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``) training on CPU / gloo: rows
against the profiler's ``gloo:<op>`` events on the same run, bytes against the sharded unit
sizes, and module / phase attribution per FSDP unit. (CommDebugMode cannot witness FSDP on
torch 2.13: its module tracker raises IndexError in ``_fw_set_module_hook`` under FSDP.)"""

from collections import Counter

import pytest

from tests import integration_workers as w
from tests.multiproc import run_ranks
from tests.torch_compat import leaf

# FSDP2 gathers with all_gather_single; FSDP1 on CPU tensors with the list all_gather (a CPU
# special case in FlatParamHandle._all_gather_flat_param). Both reduce gradients with
# reduce_scatter_single, which gloo runs as an all_reduce of the full gradient.
GATHER = {"fsdp2": leaf("all_gather_into_tensor"), "fsdp1": "all_gather"}
REDUCE = leaf("reduce_scatter_tensor")


@pytest.fixture(scope="module")
def run():
    return run_ranks(w.fsdp, 2, timeout=120)


@pytest.fixture(autouse=True)
def _fsdp2_on_cpu(request):
    from tests.torch_compat import fsdp2_cpu_unsupported

    reason = fsdp2_cpu_unsupported()
    if reason and getattr(request.node, "callspec", None) and request.node.callspec.params.get("kind") == "fsdp2":
        pytest.skip(reason)


@pytest.mark.parametrize("kind", sorted(GATHER))
def test_fsdp_rows_match_profiler(run, kind):
    for out, errors in run:
        df, witness, _ = out[kind]
        assert not errors
        # 2 steps x 2 units: a gather in forward and one in backward, a reduction in backward
        assert w.claimed_counts(df) == witness == {"all_gather": 8, "all_reduce": 4}
        assert Counter(df["op"].astype(str)) == {GATHER[kind]: 8, REDUCE: 4}
        assert (df["timing"] == "host").all() and (df["duration_us"] > 0).all()


@pytest.mark.parametrize("kind", sorted(GATHER))
def test_fsdp_bytes_are_the_sharded_unit_sizes(run, kind):
    for out, _ in run:
        df, _, sharded = out[kind]
        assert set(df["module"].astype(str)) == set(sharded)
        for unit, rows in df.groupby("module", observed=True):
            assert (rows["bytes"] == sharded[unit]).all(), unit  # every rank's shard of that unit


@pytest.mark.parametrize("kind", sorted(GATHER))
def test_fsdp_rows_attributed_to_their_unit_and_phase(run, kind):
    """Backward gathers run from FSDP's tensor hooks (before the root's backward marker) and are
    prefetched from the next unit's hook: still named by the unit gathered, phase backward."""
    for out, _ in run:
        df, _, sharded = out[kind]
        got = Counter(zip(df["module"].astype(str), df["phase"].astype(str), df["op"].astype(str)))
        expected = Counter()
        for unit in sharded:
            expected.update(
                {(unit, "forward", GATHER[kind]): 2, (unit, "backward", GATHER[kind]): 2, (unit, "backward", REDUCE): 2}
            )
        assert got == expected
