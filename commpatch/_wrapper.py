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
import inspect
import itertools
import threading
import time

from . import _runtime
from ._log import CHUNK_MASK, ROW, F_ASYNC, F_CUDA, F_ERROR, T_HOST, T_NONE, T_SHIFT
from ._targets import OBJECT, OP_CODE, Target, group_peer, make_reader, reader_lines

SEQ = itertools.count()   # per-process sequence shared by all wrappers; next() is atomic
MARK = "__commpatch_original__"


# The per-op wrapper: argument reading and the synchronous-CPU record inlined; everything
# else (CUDA events, async futures, nested object collectives, coalescing) goes to `slow`.
_FAST = """
def {name}({params}):
    if not state.recording:
        return orig({call})
    if state.nesting and local.depth:   # a plain read unless some nesting op is running
        return inner({args}, {kwargs})
    try:
{read}
        gid = group_ids.get(group)
        if gid is None:
            gid = log.group_id(group)
        if gid < 0:                 # this rank is not in the group: torch does nothing
            return orig({call})
        go_slow = {slow_test}
        if not go_slow:
            dc = {dtype_code}
            seq = next_seq()
    except Exception as exc:        # never break the user's call
        fail("read", exc)
        return orig({call})
    if go_slow:                     # outside the guard: torch's own errors must not re-run the call
        return slow({args}, {kwargs}, t, numel, group, gid, async_op, peer)
    start = pc()
    try:
        result = orig({call})
    except BaseException:
        error_row(seq, t, numel, gid, peer, async_op, start)
        raise
    end = pc()
    try:
        extend(pack(seq, code, gid, dc, numel, HOST, start, end, peer, state.step, state.tag, state.where))
        if not seq & CHUNK_MASK:
            maintain(seq)
    except Exception as exc:
        fail("record", exc)
    return result
"""
# Names the generated code uses itself: a torch parameter with one of these names makes the
# generator fall back to the generic (*args, **kwargs) form.
_RESERVED = {"state", "orig", "local", "inner", "group_ids", "gid", "log", "go_slow", "dc", "seq", "exc",
             "fail", "slow", "t", "numel", "async_op_", "peer", "start", "pc", "result", "error_row",
             "end", "extend", "pack", "code", "HOST", "maintain", "CHUNK_MASK", "next_seq", "dtype_ids",
             "coalescing", "group_peer", "n", "args", "kwargs", "ops", "x", "xs", "p"}


def signature_source(fn):
    """(parameters, call, args tuple, kwargs dict, defaults) source for a wrapper with ``fn``'s
    own signature (the ``decorator`` package's technique): arguments are plain locals and the
    call forwards them positionally, with no ``*args, **kwargs`` repacking. None if it cannot."""
    params, call, pos, kw, defaults = [], [], [], [], {}
    seen_star = seen_posonly = False
    for p in inspect.signature(fn).parameters.values():
        if p.name in _RESERVED:
            return None
        default = ""
        if p.default is not inspect.Parameter.empty:
            defaults[f"_d_{p.name}"] = p.default
            default = f"=_d_{p.name}"
        if p.kind is p.POSITIONAL_ONLY:
            seen_posonly = True
        elif seen_posonly and p.kind is not p.POSITIONAL_ONLY:
            params.append("/")
            seen_posonly = False
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            params.append(p.name + default)
            call.append(p.name)
            pos.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            seen_star = True
            params.append("*" + p.name)
            call.append("*" + p.name)
            pos.append("*" + p.name)
        elif p.kind is p.KEYWORD_ONLY:
            if not seen_star:
                params.append("*")
                seen_star = True
            params.append(p.name + default)
            call.append(f"{p.name}={p.name}")
            kw.append(f"{p.name!r}: {p.name}")
        else:  # VAR_KEYWORD
            params.append("**" + p.name)
            call.append("**" + p.name)
            kw.append("**" + p.name)
    if seen_posonly:
        params.append("/")
    args = "(" + "".join(f"{a}, " for a in pos) + ")"
    return ", ".join(params), ", ".join(call), args, "{" + ", ".join(kw) + "}", defaults


def make_wrapper(target: Target, orig, log, timing, host_only: bool = False):
    """One wrapper function for ``orig``, generated from the target's table row.

    Generated once at patch time (the namedtuple technique) so the hot path is a handful of
    indexed reads, two clock reads and one packed append: no per-call introspection and no
    extra Python call frames. Its behaviour is that of ``slow`` below, which handles every
    case the fast path hands over.
    """
    code = OP_CODE[target.name]
    leaf = target.leaf
    nested_op = target.size[0] == "nested"
    xn = target.size[0] == "xn"
    no_tensor_dtype = OBJECT if nested_op else None
    state, local, fail = _runtime.STATE, _runtime.LOCAL, _runtime.fail
    rows_append = log.rows.append
    pc = time.perf_counter_ns
    next_seq = SEQ.__next__
    coalescing = _coalesce_state()
    read = make_reader(target, orig)

    def maintain(seq):
        timing.resolve()
        log.maintain(seq)

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
                     start, end, peer, state.step, state.tag, state.where))
        if not seq & CHUNK_MASK:
            maintain(seq)

    def error_row(seq, t, numel, gid, peer, async_op, start):
        try:
            record(seq, t, numel, None, gid, peer, async_op, False, start, pc(), None, True, None)
        except Exception as exc:  # noqa: BLE001
            fail("record", exc)

    def inner(args, kwargs):
        """A call made from inside another recorded call: not a row of its own."""
        if local.nested is not None:
            _add_nested(read, xn, args, kwargs)
        return orig(*args, **kwargs)

    def slow(args, kwargs, t, numel, group, gid, async_op, peer):
        try:
            cuda = t is not None and t.is_cuda and not host_only
            ev0 = timing.cuda_start() if cuda else None
            seq = next_seq()
        except Exception as exc:  # noqa: BLE001
            fail("read", exc)
            return orig(*args, **kwargs)
        if not leaf:
            _nesting(1)
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
                _nesting(-1)
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
            _nesting(-1)
            if nested_op:
                numel, local.nested = local.nested, None
        try:
            record(seq, t, numel, group, gid, peer, async_op, cuda, start, end, result, False, ev0)
        except Exception as exc:  # noqa: BLE001
            fail("record", exc)
        return result

    slow_test = "async_op or coalescing"
    if not leaf:
        slow_test = "True"
    elif (target.tensor is not None or target.size[0] == "p2p") and not host_only and _cuda_build():
        slow_test += " or (t is not None and t.is_cuda)"   # a CPU-only torch has no CUDA tensors
    dtype_code = "dtype_ids.get(t.dtype) or log.dtype_id(t.dtype)" if target.tensor is not None \
        else str(log.dtype_id(no_tensor_dtype))
    sig = signature_source(orig)
    if sig is not None:
        params, call, args, kwargs, defaults = sig
        read_lines = reader_lines(target, orig, direct=True)
    else:
        params, call, args, kwargs, defaults = "*args, **kwargs", "*args, **kwargs", "args", "kwargs", {}
        read_lines = reader_lines(target, orig)
    source = _FAST.format(name=target.name, slow_test=slow_test, dtype_code=dtype_code, params=params,
                          call=call, args=args, kwargs=kwargs, read="\n".join(" " * 8 + ln for ln in read_lines))
    ns = dict(state=state, local=local, orig=orig, inner=inner, slow=slow, group_ids=log.group_ids, log=log,
              next_seq=next_seq, fail=fail, pc=pc, error_row=error_row, code=code,
              extend=log.buf.extend, pack=ROW.pack, dtype_ids=log.dtype_ids,
              HOST=T_HOST << T_SHIFT, CHUNK_MASK=CHUNK_MASK, maintain=maintain, coalescing=coalescing,
              group_peer=group_peer, **defaults)
    exec(compile(source, f"<commpatch wrapper {target.name}>", "exec"), ns)  # noqa: S102 - from the table
    wrapper = ns[target.name]
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


_nesting_lock = threading.Lock()


def _nesting(delta: int) -> None:
    """Count nesting ops running in any thread (the fast path's cheap hint to check LOCAL.depth)."""
    with _nesting_lock:
        _runtime.STATE.nesting += delta


def _cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


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
