"""Argument readers compiled from the op table (``data.ops``): the hot path's view of a call's
arguments, as source lines inlined into the generated wrapper or as a standalone function."""

from __future__ import annotations

import inspect

from ..data.ops import Target


def reader_lines(target: Target, fn, direct: bool = False) -> list[str]:
    """Statements that set ``t, numel, group, async_op, peer`` from the call's arguments.

    ``direct``: the code runs in a function with ``fn``'s own signature, so each parameter
    is a local variable. Otherwise it reads ``args``/``kwargs``, with positions from the
    installed function's signature. Either way the table holds only parameter names and
    works across torch versions whose positional order differs.
    """
    params = list(inspect.signature(fn).parameters)

    def arg(name: str, default: str = "None") -> str:
        if direct:
            return name if name in params else default
        if name in params:
            i = params.index(name)
            return f"(args[{i}] if n > {i} else kwargs.get({name!r}, {default}))"
        return f"kwargs.get({name!r}, {default})"

    lines = [] if direct else ["n = len(args)"]
    lines.append(f"group = {arg('group')}" if "group" in params else "group = None")
    rule, sparam = target.size
    if target.tensor is not None:
        lines.append(f"t = {arg(target.tensor)}")
        if target.tensor.endswith(("_list", "tensors")):
            lines.append("t = t[0] if t else None")
    else:
        lines.append("t = None")
    if rule in ("t", "xn"):
        lines.append("numel = t.numel()" if sparam == target.tensor else f"numel = {arg(sparam)}.numel()")
    elif rule == "list":
        lines.append(f"numel = sum([x.numel() for x in {arg(sparam)}])")
    elif rule == "lists":
        lines.append(f"numel = sum([x.numel() for xs in {arg(sparam)} for x in xs])")
    elif rule == "p2p":
        lines += [
            f"ops = {arg(sparam)}",
            "t = ops[0].tensor if ops else None",
            "numel = sum([p.tensor.numel() for p in ops])",
            "group = ops[0].group if ops else None",
            # the global rank every op exchanges with; -1 when they name several (no one peer)
            "peers = {p.peer for p in ops}",
            "peer = next(iter(peers)) if len(peers) == 1 else -1",
        ]
    else:
        lines.append("numel = 0")
    if isinstance(target.asynchronous, bool):
        lines.append(f"async_op = {target.asynchronous}")
    else:
        lines.append(f"async_op = {arg(target.asynchronous, 'False')}")
    if target.peer:
        gname, lname = target.peer
        lines.append(f"peer = {arg(gname)}")
        if lname in params:
            lines += ["if peer is None:", f"    peer = group_peer(group, {arg(lname)})"]
    elif rule != "p2p":
        lines.append("peer = -1")
    return lines


def make_reader(target: Target, fn):
    """``read(args, kwargs) -> (t, numel, group, async_op, peer)`` compiled from reader_lines."""
    body = "\n".join("    " + line for line in reader_lines(target, fn))
    source = f"def read(args, kwargs):\n{body}\n    return t, numel, group, async_op, peer\n"
    ns = {"group_peer": group_peer}
    exec(source, ns)  # noqa: S102 - source built from the table above only
    return ns["read"]


def group_peer(group, group_rank) -> int:
    """Global rank of a group-local peer, -1 when unknown."""
    if group_rank is None:
        return -1
    if group is None:
        return group_rank
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank)
