"""The single generic wrapper used for every target in the table.

Shape (the same for every op): bail-out when not recording; depth guard so nested
internal calls are not counted twice; argument reading; the real call; bookkeeping in
``try/except Exception`` that warns once and counts the failure. Exceptions raised by
torch propagate unchanged and leave a row with ``status=error``.

The wrapper is a plain Python function (not a ``wrapt.FunctionWrapper``): a wrapt proxy
call alone costs ~0.9 us, a closure ~0.15 us, and dynamo's collective rewrite only accepts
real functions (``inspect.isfunction``). wrapt manages the patching and import hooks.
"""

from __future__ import annotations

import functools
import itertools
import time

from . import _runtime
from ._log import CHUNK_MASK, F_ASYNC, F_CUDA, F_ERROR, T_HOST, T_NONE, T_SHIFT
from ._targets import OBJECT, OP_CODE, Target, make_reader

SEQ = itertools.count()   # per-process sequence shared by all wrappers; next() is atomic
MARK = "__commpatch_original__"


def make_wrapper(target: Target, orig, log, timing, host_only: bool = False):
    read = make_reader(target, orig)
    code = OP_CODE[target.name]
    leaf = target.leaf
    nested_op = target.size[0] == "nested"
    xn = target.size[0] == "xn"
    no_tensor_dtype = OBJECT if nested_op else None
    state, local, fail = _runtime.STATE, _runtime.LOCAL, _runtime.fail
    rows_append = log.rows.append
    group_ids = log.group_ids
    pc = time.perf_counter_ns
    next_seq = SEQ.__next__
    coalescing = _coalesce_state()

    def record(seq, t, numel, group, gid, peer, async_op, cuda, start, end, result, err, ev0):
        try:
            if coalescing and _in_coalescing(coalescing, group):
                tcode = T_NONE         # deferred: the coalesced op runs when the manager exits
            elif cuda and not err:
                tcode = timing.cuda_end(seq, ev0, result, async_op)
            elif async_op and not err:
                tcode = timing.future(seq, start, result, code)
            else:
                tcode = T_HOST
        except Exception as exc:  # noqa: BLE001 - keep the row, without a duration
            fail("timing", exc)
            tcode = T_NONE
        flags = (async_op and F_ASYNC) | (cuda and F_CUDA) | (err and F_ERROR) | (tcode << T_SHIFT)
        rows_append((seq, code, gid, t.dtype if t is not None else no_tensor_dtype, numel, flags,
                     start, end, peer, state.step, state.tag))
        if not seq & CHUNK_MASK:
            timing.resolve()
            log.compact()

    def wrapper(*args, **kwargs):
        if not state.recording:
            return orig(*args, **kwargs)
        if local.depth:
            if local.nested is not None:
                _add_nested(read, xn, args, kwargs)
            return orig(*args, **kwargs)
        try:
            t, numel, group, async_op, peer = read(args, kwargs)
            gid = group_ids.get(group)
            if gid is None:
                gid = log.group_id(group)
            if gid < 0:            # this rank is not in the group: torch does nothing
                return orig(*args, **kwargs)
            cuda = t is not None and t.is_cuda and not host_only
            ev0 = timing.cuda_start() if cuda else None
            seq = next_seq()
        except Exception as exc:  # noqa: BLE001 - never break the user's call
            fail("read", exc)
            return orig(*args, **kwargs)
        if not leaf:
            local.depth = 1
            if nested_op:
                local.nested = 0
        start = pc()
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            end = pc()
            if not leaf:
                local.depth = 0
                if nested_op:
                    numel, local.nested = local.nested or 0, None
            try:
                record(seq, t, numel, group, gid, peer, async_op, cuda, start, end, None, True, ev0)
            except Exception as exc:  # noqa: BLE001
                fail("record", exc)
            raise
        end = pc()
        if not leaf:
            local.depth = 0
            if nested_op:
                numel, local.nested = local.nested, None
        try:
            record(seq, t, numel, group, gid, peer, async_op, cuda, start, end, result, False, ev0)
        except Exception as exc:  # noqa: BLE001
            fail("record", exc)
        return result

    functools.update_wrapper(wrapper, orig)
    setattr(wrapper, MARK, orig)
    return wrapper


def _add_nested(read, xn, args, kwargs) -> None:
    """An object collective's inner call: add the bytes it moves to the outer row."""
    try:
        t, numel, group, _, _ = read(args, kwargs)
        if t is not None:
            if xn:
                import torch.distributed as dist

                numel *= dist.get_world_size(group)
            _runtime.LOCAL.nested += numel * t.element_size()
    except Exception as exc:  # noqa: BLE001
        _runtime.fail("nested", exc)


def _in_coalescing(coalescing, group) -> bool:
    if group is None:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
    return group in coalescing


def _coalesce_state():
    """torch's dict of groups currently inside ``_coalescing_manager`` (empty almost always)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return _world.pg_coalesce_state
    except Exception:  # noqa: BLE001 - older torch: no coalescing manager state
        return {}
