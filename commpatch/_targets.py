"""The declarative table of what is wrapped, and how each call's arguments are read.

One row per public ``torch.distributed`` function. Patch, unpatch, argument reading,
byte counting and the bus-bandwidth factor are all driven from this table; nothing else
lists op names.

Size rules (``S`` is the message size as nccl-tests counts it, DESIGN.md section 4):

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

import inspect
from dataclasses import dataclass, field

C10D = "torch.distributed.distributed_c10d"
DIST = "torch.distributed"

# Bus-bandwidth factor kinds; analysis maps them to formulas of the group size n.
ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, ROOTED_N, ONE, NO_BW = (
    "allreduce", "allgather", "reducescatter", "alltoall", "rooted_n", "one", "none")


@dataclass(frozen=True)
class Target:
    name: str
    tensor: str | None            # parameter giving dtype/device (a tensor, or a list whose first item is used)
    size: tuple[str, str | None]  # (rule, parameter) -> numel of S
    bw: str                       # bus-bandwidth factor kind
    asynchronous: str | bool = "async_op"  # parameter name, True (always returns Work), False (never)
    peer: tuple[str, str] | None = None    # (global-rank parameter, group-rank parameter)
    leaf: bool = True             # False: may call other wrapped functions (depth guard needed)
    also_in: tuple[str, ...] = field(default=())  # modules that bind the name at import


_T = Target
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
    _T("broadcast", "tensor", ("t", "tensor"), ONE, peer=("src", "group_src"),
       also_in=("torch.distributed.tensor._collective_utils",)),
    _T("broadcast_object_list", None, ("nested", None), NO_BW, False, peer=("src", "group_src"), leaf=False),
    _T("reduce", "tensor", ("t", "tensor"), ONE, peer=("dst", "group_dst")),
    _T("all_to_all", "input_tensor_list", ("list", "input_tensor_list"), ALLTOALL),
    _T("all_to_all_single", "input", ("t", "input"), ALLTOALL),
    _T("gather", "tensor", ("xn", "tensor"), ROOTED_N, peer=("dst", "group_dst")),
    _T("gather_object", None, ("nested", None), NO_BW, False, peer=("dst", "group_dst"), leaf=False),
    _T("scatter", "tensor", ("xn", "tensor"), ROOTED_N, peer=("src", "group_src"),
       also_in=("torch.distributed.tensor._collective_utils",)),
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
TARGET_NAMES: tuple[str, ...] = tuple(t.name for t in TARGETS)
BY_NAME = {t.name: t for t in TARGETS}
OP_CODE = {name: i for i, name in enumerate(TARGET_NAMES)}

# dtype sentinels for rows without a tensor of their own
NO_TENSOR = None
OBJECT = "object"


def make_reader(target: Target, fn) -> "callable":
    """Compile ``read(args, kwargs) -> (tensor, numel, group, async_op, peer)`` for ``fn``.

    Positions come from the installed function's own signature, so the table holds only
    parameter names and works across torch versions whose positional order differs.
    Generated once per target at patch time (the namedtuple technique): the hot path is
    then a handful of indexed reads with no per-call introspection.
    """
    params = list(inspect.signature(fn).parameters)

    def arg(name: str, default: str = "None") -> str:
        if name in params:
            i = params.index(name)
            return f"(args[{i}] if n > {i} else kwargs.get({name!r}, {default}))"
        return f"kwargs.get({name!r}, {default})"

    lines = ["def read(args, kwargs):", "    n = len(args)"]
    lines.append(f"    group = {arg('group')}" if "group" in params else "    group = None")
    rule, sparam = target.size
    if target.tensor is not None:
        lines.append(f"    t = {arg(target.tensor)}")
        if target.tensor.endswith(("_list", "tensors")):
            lines.append("    t = t[0] if t else None")
    else:
        lines.append("    t = None")
    if rule in ("t", "xn"):
        if sparam == target.tensor:
            lines.append("    numel = t.numel()")
        else:
            lines.append(f"    numel = {arg(sparam)}.numel()")
    elif rule == "list":
        lines.append(f"    numel = sum([x.numel() for x in {arg(sparam)}])")
    elif rule == "lists":
        lines.append(f"    numel = sum([x.numel() for xs in {arg(sparam)} for x in xs])")
    elif rule == "p2p":
        lines.append(f"    ops = {arg(sparam)}")
        lines.append("    t = ops[0].tensor if ops else None")
        lines.append("    numel = sum([p.tensor.numel() for p in ops])")
        lines.append("    group = ops[0].group if ops else None")
    else:
        lines.append("    numel = 0")
    if target.asynchronous is True or target.asynchronous is False:
        lines.append(f"    async_op = {target.asynchronous}")
    else:
        lines.append(f"    async_op = {arg(target.asynchronous, 'False')}")
    if target.peer:
        gname, lname = target.peer
        lines.append(f"    peer = {arg(gname)}")
        if lname in params:
            lines.append("    if peer is None:")
            lines.append(f"        peer = group_peer(group, {arg(lname)})")
    else:
        lines.append("    peer = -1")
    lines.append("    return t, numel, group, async_op, peer")
    ns = {"group_peer": _group_peer}
    exec("\n".join(lines), ns)  # noqa: S102 - source built from the table above only
    read = ns["read"]
    read.__source__ = "\n".join(lines)
    return read


def _group_peer(group, group_rank) -> int:
    """Global rank of a group-local peer, -1 when unknown."""
    if group_rank is None:
        return -1
    if group is None:
        return group_rank
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank)
