"""The declarative table of what is wrapped, and how each call's arguments are read.

One row per public ``torch.distributed`` function (plus the extra ops the integrations
record). Data only: no torch import; ``record.readers`` compiles each row's argument reader. Patch, unpatch, argument reading,
byte counting and the bus-bandwidth factor are all driven from this table; nothing else
lists op names.

Size rules (``S`` is the message size as nccl-tests counts it):

- ``t``      numel of one tensor argument
- ``list``   sum of numel over a list of tensors
- ``lists``  sum of numel over a list of lists of tensors
- ``xn``     numel of one tensor times the group size (gather / scatter: S is the full buffer,
             which only the root holds as a list)
- ``p2p``    sum of numel over the tensors of a ``batch_isend_irecv`` op list
- ``nested`` bytes of the collectives the call issues internally (object collectives)
- ``none``   nothing moves (barriers)
"""

from __future__ import annotations

from dataclasses import dataclass, field

C10D = "torch.distributed.distributed_c10d"
DIST = "torch.distributed"

# Bus-bandwidth factor kinds; analysis maps them to formulas of the group size n.
ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, ROOTED_N, ONE, NO_BW = (
    "allreduce",
    "allgather",
    "reducescatter",
    "alltoall",
    "rooted_n",
    "one",
    "none",
)


@dataclass(frozen=True)
class Target:
    name: str
    tensor: str | None  # parameter giving dtype/device (a tensor, or a list whose first item is used)
    size: tuple[str, str | None]  # (rule, parameter) -> numel of S
    bw: str  # bus-bandwidth factor kind
    asynchronous: str | bool = "async_op"  # parameter name, True (always returns Work), False (never)
    peer: tuple[str, str] | None = None  # (global-rank parameter, group-rank parameter)
    leaf: bool = True  # False: may call other wrapped functions (depth guard needed)
    also_in: tuple[str, ...] = field(default=())  # modules that bind the name at import
    runs: tuple[str, ...] = ()  # extra ops only: the collectives issued underneath (profiler names)


_T = Target
# modules that bind broadcast / scatter at import: DTensor's collective utilities (torch.distributed.tensor
# since torch 2.5, torch.distributed._tensor before; a module torch lacks is skipped)
COLLECTIVE_UTILS = ("torch.distributed.tensor._collective_utils", "torch.distributed._tensor._collective_utils")
TARGETS: tuple[Target, ...] = (
    _T("all_reduce", "tensor", ("t", "tensor"), ALLREDUCE),
    _T("all_reduce_coalesced", "tensors", ("list", "tensors"), ALLREDUCE),
    _T("all_gather", "tensor", ("list", "tensor_list"), ALLGATHER),
    _T("all_gather_into_tensor", "input_tensor", ("t", "output_tensor"), ALLGATHER, leaf=False),
    _T("all_gather_single", "input_tensor", ("t", "output_tensor"), ALLGATHER),
    _T("_all_gather_base", "input_tensor", ("t", "output_tensor"), ALLGATHER, leaf=False),
    _T("all_gather_coalesced", "input_tensor_list", ("lists", "output_tensor_lists"), ALLGATHER),
    _T("all_gather_object", None, ("nested", None), NO_BW, False, leaf=False),
    _T("reduce_scatter", "output", ("list", "input_list"), REDUCESCATTER),
    _T("reduce_scatter_tensor", "input", ("t", "input"), REDUCESCATTER, leaf=False),
    _T("reduce_scatter_single", "input", ("t", "input"), REDUCESCATTER),
    _T("_reduce_scatter_base", "input", ("t", "input"), REDUCESCATTER, leaf=False),
    _T("broadcast", "tensor", ("t", "tensor"), ONE, peer=("src", "group_src"), also_in=COLLECTIVE_UTILS),
    _T("broadcast_object_list", None, ("nested", None), NO_BW, False, peer=("src", "group_src"), leaf=False),
    _T("reduce", "tensor", ("t", "tensor"), ONE, peer=("dst", "group_dst")),
    _T("all_to_all", "input_tensor_list", ("list", "input_tensor_list"), ALLTOALL),
    _T("all_to_all_single", "input", ("t", "input"), ALLTOALL),
    _T("gather", "tensor", ("xn", "tensor"), ROOTED_N, peer=("dst", "group_dst")),
    _T("gather_object", None, ("nested", None), NO_BW, False, peer=("dst", "group_dst"), leaf=False),
    _T("scatter", "tensor", ("xn", "tensor"), ROOTED_N, peer=("src", "group_src"), also_in=COLLECTIVE_UTILS),
    _T("scatter_object_list", None, ("nested", None), NO_BW, False, peer=("src", "group_src"), leaf=False),
    _T("barrier", None, ("none", None), NO_BW),
    _T("monitored_barrier", None, ("none", None), NO_BW, False),
    _T("send", "tensor", ("t", "tensor"), ONE, False, peer=("dst", "group_dst"), leaf=False),
    _T("recv", "tensor", ("t", "tensor"), ONE, False, peer=("src", "group_src"), leaf=False),
    _T("isend", "tensor", ("t", "tensor"), ONE, True, peer=("dst", "group_dst")),
    _T("irecv", "tensor", ("t", "tensor"), ONE, True, peer=("src", "group_src")),
    _T("batch_isend_irecv", None, ("p2p", "p2p_op_list"), ONE, True, leaf=False),
    _T("send_object_list", None, ("nested", None), NO_BW, False, peer=("dst", "group_dst"), leaf=False),
    _T("recv_object_list", None, ("nested", None), NO_BW, False, peer=("src", "group_src"), leaf=False),
)
# torch.distributed functions newer than the table above: patched like the others, their op codes
# appended after EXTRA_OPS (the codes of older files stay valid)
NEWER_TARGETS: tuple[Target, ...] = (
    # torch 2.15: gather into one tensor on the root (NCCL >= 2.28.3 natively; gloo: "does not support")
    _T("gather_single", "tensor", ("xn", "tensor"), ROOTED_N, peer=("dst", "group_dst")),
    _T("gather_into_tensor", "tensor", ("xn", "tensor"), ROOTED_N, peer=("dst", "group_dst"), leaf=False),  # its alias
)
_FIRST_TARGETS, TARGETS = TARGETS, TARGETS + NEWER_TARGETS
TARGET_NAMES: tuple[str, ...] = tuple(t.name for t in TARGETS)

# Ops recorded by commpatch/integrations (not patch targets of torch.distributed): rows for
# collectives issued from C++ (DDP's reducer) or by other APIs (functional collectives).
# Same size rules and bandwidth kinds; ``runs`` names what a profiler sees underneath.
EXTRA_OPS: tuple[Target, ...] = (
    _T("ddp_bucket_allreduce", None, ("t", None), ALLREDUCE, True, runs=("all_reduce",)),
    _T("ddp_broadcast_coalesced", None, ("list", None), ONE, False, runs=("broadcast",)),  # one row per broadcast
    # one 0-byte row per call: written by commpatch before issue 16, kept to read older files
    _T("ddp_verify_params", None, ("none", None), NO_BW, False, runs=("all_gather", "broadcast")),
    _T("ddp_rebuild_buckets", None, ("none", None), NO_BW, False, runs=("broadcast", "broadcast")),
    _T("funcol.all_reduce", None, ("t", None), ALLREDUCE, True, runs=("all_reduce",)),
    _T("funcol.all_reduce_coalesced", None, ("list", None), ALLREDUCE, True, runs=("all_reduce",)),
    _T("funcol.all_gather", None, ("xn", None), ALLGATHER, True, runs=("all_gather",)),
    _T("funcol.all_gather_coalesced", None, ("xn", None), ALLGATHER, True, runs=("all_gather",)),
    _T("funcol.reduce_scatter", None, ("t", None), REDUCESCATTER, True, runs=("reduce_scatter",)),
    _T("funcol.reduce_scatter_coalesced", None, ("list", None), REDUCESCATTER, True, runs=("reduce_scatter",)),
    _T("funcol.all_to_all_single", None, ("t", None), ALLTOALL, True, runs=("all_to_all",)),
    _T("funcol.broadcast", None, ("t", None), ONE, True, runs=("broadcast",)),
    # one row per _coalescing_manager exit, named after the queued calls (integrations/coalescing.py)
    _T("coalesced.all_reduce", None, ("list", None), ALLREDUCE, runs=("all_reduce",)),
    _T("coalesced.all_gather_single", None, ("list", None), ALLGATHER, runs=("all_gather",)),
    _T("coalesced.reduce_scatter_single", None, ("list", None), REDUCESCATTER, runs=("reduce_scatter",)),
    # issue 16 (appended: op codes of older files stay valid). torch.ops._c10d_functional called by
    # compiled code (integrations/compiled.py), S counted as the funcol.* rows count it
    _T("compiled.all_reduce", None, ("t", None), ALLREDUCE, True, runs=("all_reduce",)),
    _T("compiled.all_reduce_coalesced", None, ("list", None), ALLREDUCE, True, runs=("all_reduce",)),
    _T("compiled.all_gather_into_tensor", None, ("xn", None), ALLGATHER, True, runs=("all_gather",)),
    _T("compiled.all_gather_into_tensor_coalesced", None, ("xn", None), ALLGATHER, True, runs=("all_gather",)),
    _T("compiled.reduce_scatter_tensor", None, ("t", None), REDUCESCATTER, True, runs=("reduce_scatter",)),
    _T("compiled.reduce_scatter_tensor_coalesced", None, ("list", None), REDUCESCATTER, True, runs=("reduce_scatter",)),
    _T("compiled.all_to_all_single", None, ("t", None), ALLTOALL, True, runs=("all_to_all",)),
    _T("compiled.broadcast", None, ("t", None), ONE, True, runs=("broadcast",)),
    # what DDP's C++ issues, one row per collective (the constructor's check and broadcast, the
    # bucket rebuild, the reducer's unused-parameter bitmap; integrations/ddp.py)
    _T("ddp_verify_params_allgather", None, ("t", None), ALLGATHER, True, runs=("all_gather",)),
    _T("ddp_verify_params_broadcast", None, ("t", None), ONE, True, runs=("broadcast",)),
    _T("ddp_rebuild_buckets_broadcast", None, ("t", None), ONE, True, runs=("broadcast",)),
    _T("ddp_unused_allreduce", None, ("t", None), ALLREDUCE, True, runs=("all_reduce",)),
    # a _coalescing_manager's rows on torch < 2.5, whose queued calls are the public functions
    _T("coalesced.all_gather_into_tensor", None, ("list", None), ALLGATHER, runs=("all_gather",)),
    _T("coalesced.reduce_scatter_tensor", None, ("list", None), REDUCESCATTER, runs=("reduce_scatter",)),
)
OP_NAMES: tuple[str, ...] = tuple(
    t.name for t in _FIRST_TARGETS + EXTRA_OPS + NEWER_TARGETS
)  # an op's code is its place here

# What each op is, as three separate facts (the `op` column folds them into one name):
# collective (the nccl-tests kind), api (the function actually called, torch's own name) and
# source (who issued it). Derived when a DataFrame is built: nothing on the hot path.
_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)
_SPECIAL = {
    "_all_gather_base": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "monitored_barrier": "barrier",
    "isend": "send",
    "irecv": "recv",
    "batch_isend_irecv": "send_recv",
    "ddp_bucket_allreduce": "all_reduce",
    "ddp_broadcast_coalesced": "broadcast",
    "ddp_verify_params": "all_gather",
    "ddp_rebuild_buckets": "broadcast",
    "ddp_verify_params_allgather": "all_gather",
    "ddp_verify_params_broadcast": "broadcast",
    "ddp_rebuild_buckets_broadcast": "broadcast",
    "ddp_unused_allreduce": "all_reduce",
}
_DDP_API = {
    "ddp_bucket_allreduce": "Reducer.allreduce",
    "ddp_broadcast_coalesced": "_broadcast_coalesced",
    "ddp_verify_params": "_verify_params_across_processes",
    "ddp_rebuild_buckets": "Reducer._rebuild_buckets",
    "ddp_verify_params_allgather": "_verify_params_across_processes",
    "ddp_verify_params_broadcast": "_verify_params_across_processes",
    "ddp_rebuild_buckets_broadcast": "Reducer._rebuild_buckets",
    "ddp_unused_allreduce": "Reducer.all_reduce_local_used_map",
}


def describe_op(name: str) -> tuple[str, str, str]:
    """(collective, api, source) of an op name of this table (or of an older file's)."""
    source, _, api = name.rpartition(".") if "." in name else ("c10d", "", name)
    if name in _DDP_API:
        source, api = "ddp", _DDP_API[name]
    source = {"coalesced": "coalescing"}.get(source, source)
    collective = _SPECIAL.get(name) or next((k for k in _KINDS if api.lstrip("_").startswith(k)), api)
    return collective, api, source


BY_NAME = {t.name: t for t in TARGETS + EXTRA_OPS}
OP_CODE = {name: i for i, name in enumerate(OP_NAMES)}
# point-to-point ops: two ranks only, numbered apart from a group's collectives (analysis.matching)
P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")

# dtype name of the rows of object collectives (their bytes are those of the tensors they moved)
OBJECT = "object"


def bus_factor(kind: str, n):
    """nccl-tests bus-bandwidth factor for a factor kind and group size(s) ``n``."""
    import numpy as np

    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == ALLREDUCE:
            return 2.0 * (n - 1) / n
        if kind in (ALLGATHER, REDUCESCATTER, ALLTOALL, ROOTED_N):
            return (n - 1) / n
        if kind == ONE:
            return np.ones_like(n)
        if kind == NO_BW:
            return np.full_like(n, np.nan)
    raise ValueError(f"unknown bandwidth kind {kind!r}")
