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
import re
import sys
import threading
import time

from ..data.ops import OBJECT, OP_CODE, Target
from ..data.schema import ROW, T_DEVICE, T_FUTURE, T_HOST, T_NCCL, T_NONE, T_SHIFT, pack_flags
from . import state as _runtime
from .log import CHUNK_MASK
from .readers import group_peer, make_reader, reader_lines
from .rows import SEQ, SLOW, Pending, hot_call, on_device, write_row
from .state import COALESCING

MARK = "__commpatch_original__"  # attribute of every wrapper commpatch installs: the original


# The per-op wrapper: argument reading and the synchronous-CPU record inlined; everything
# else (device events, async futures, nested object collectives, coalescing) goes to `slow`.
_HEAD = """
def {name}({params}):
    if not state.recording:
        return orig({call})
    if state.nesting and local.depth:   # a plain read unless some nesting op is running
        return inner({args}, {kwargs})"""
_BODY = """
    try:
{read}
        gid = group_ids.get(group)
        if gid is None:
            gid = log.group_id(group)
        go_slow = gid < 0 or {slow_test}
        if not go_slow:
            dc = {dtype_code}
            seq = next_seq()
    except Exception as exc:        # never break the user's call
        fail("read", exc)
        return orig({call})
    if go_slow:                     # outside the guard: torch's own errors must not re-run the call
        if gid < 0:                 # not in the group (torch does nothing), or no process group yet
            return orig({call})     # (torch's own error, the user's, raised once)
        return slow({args}, {kwargs}, t, numel, group, gid, async_op, peer)
    start = pc(){watch_enter}
    try:
        result = orig({call})
    except BaseException:{watch_exit_err}
        error_row(seq, t, numel, gid, peer, async_op, start)
        raise
    end = pc(){watch_exit}
    try:
        extend(pack(seq, code, gid, dc, numel, HOST, start, end, peer, state.step, state.tag, state.where))
        if not seq & CHUNK_MASK:
            maintain(seq)
    except Exception as exc:
        fail("record", exc)
    return result
"""
# With the C recorder (record/_hot.c), the common case (synchronous, a plain CPU tensor, a known
# group) is one C call after the argument reads: the checks, the group lookup, both clock reads,
# the call, seq, dtype, element count, pack and append (~0.2 us less than _BODY). It answers SLOW
# for anything else, which _BODY then takes as before. A single tensor's element count is not read
# before the call: the recorder reads it (t.nbytes over the element size, half the cost of
# t.numel()); _BODY reads it first.
# The recorder checks first that commpatch records and that no nesting op runs in any thread (and
# calls orig alone when it does not record): the generated function reads the arguments, calls it,
# and makes those checks itself only for a call the recorder hands back (fewer bytecodes on the
# common path). Reads that are plain names need no guard.
_C_HEAD = """
def {name}({params}):{read}
    result = call(group, t, {numel_c}, peer, async_op, {call})
    if result is not SLOW:
        return result
    if not state.recording:
        return orig({call})
    if state.nesting and local.depth:
        return inner({args}, {kwargs})"""
_C_READ = """
    try:
{read}
    except Exception as exc:        # never break the user's call
        if state.recording:
            fail("read", exc)
        return orig({call})"""
# Names the generated code uses itself: a torch parameter with one of these names makes the
# generator fall back to the generic (*args, **kwargs) form.
_RESERVED = {
    "state",
    "orig",
    "local",
    "inner",
    "group_ids",
    "gid",
    "log",
    "go_slow",
    "dc",
    "seq",
    "exc",
    "fail",
    "slow",
    "t",
    "numel",
    "peer",
    "start",
    "pc",
    "result",
    "error_row",
    "end",
    "extend",
    "pack",
    "code",
    "HOST",
    "maintain",
    "CHUNK_MASK",
    "next_seq",
    "dtype_ids",
    "coalescing",
    "group_peer",
    "n",
    "args",
    "kwargs",
    "ops",
    "x",
    "xs",
    "p",
    "Tensor",
    "Pending",
    "pending",
    "get_ident",
    "call",
    "SLOW",
}


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
    pc = time.perf_counter_ns
    next_seq = SEQ.__next__
    coalescing = _coalesce_state()
    read = make_reader(target, orig)
    watch = bool(_runtime.STATE.settings.get("watchdog"))
    pending = log.pending
    get_ident = threading.get_ident
    import torch

    Tensor = torch.Tensor

    def maintain(seq):
        timing.resolve()
        log.maintain(seq)

    def record(seq, t, numel, group, gid, peer, async_op, dev, start, end, result, err, ev0, queued=False):
        if (async_op or dev) and not err:
            # in flight until its timing resolves: registered before the completion callback is
            # attached, because then() on an already completed future runs the callback inline
            pending[seq] = Pending(code, gid, numel, get_ident(), start, _issue_stack() if watch else None)
        try:
            if queued:
                tcode = T_NONE  # only queued: the coalesced op runs when the manager exits
            elif dev and not err:
                tcode = timing.device_end(seq, gid, ev0, result, async_op)
            elif async_op and not err:
                tcode = timing.future(seq, start, result, code)
            else:
                tcode = T_HOST
        except Exception as exc:  # noqa: BLE001 - keep the row, without a duration
            fail("timing", exc)
            tcode = T_NONE
        if tcode not in PENDING_TIMINGS:
            pending.pop(seq, None)
        write_row(
            log,
            seq,
            code,
            gid,
            t.dtype if t is not None else no_tensor_dtype,
            numel,
            pack_flags(async_op, dev, err, tcode),
            start,
            end,
            peer,
        )
        if not seq & CHUNK_MASK:
            maintain(seq)

    def error_row(seq, t, numel, gid, peer, async_op, start):
        try:
            record(seq, t, numel, None, gid, peer, async_op, False, start, pc(), None, True, None)
        except Exception as exc:  # noqa: BLE001
            fail("record", exc)

    def inner(args, kwargs):
        """A call made from inside another recorded call: not a row of its own. Its bytes count
        for an object collective's row, not those of the calls it makes itself (``send`` calls
        ``isend``: counted twice before issue 23)."""
        if local.nested is None:
            return orig(*args, **kwargs)
        _add_nested(read, xn, args, kwargs)
        counted, local.nested = local.nested, None
        try:
            return orig(*args, **kwargs)
        finally:
            local.nested = counted

    def slow(args, kwargs, t, numel, group, gid, async_op, peer):
        try:
            dev = not host_only and t is not None and on_device(t, log)
            guard = not leaf or (t is not None and t.__class__ is not Tensor)  # see slow_test
            seq = next_seq()
            pg = _coalesce_group(group) if coalescing else None  # a _coalescing_manager is open
            queue = coalescing.get(pg) if pg is not None else None
            before = len(queue) if queue is not None else 0
        except Exception as exc:  # noqa: BLE001
            fail("read", exc)
            return orig(*args, **kwargs)
        try:
            ev0 = timing.device_start(t) if dev else None
        except Exception as exc:  # noqa: BLE001 - device events unusable: the row stays, untimed
            fail("timing", exc)
            ev0 = None
        if guard:
            _nesting(1)
            local.depth = 1
            if nested_op:
                local.nested = 0
        if watch:
            pending[seq] = Pending(code, gid, numel, get_ident(), pc(), None)
        start = pc()
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            end = pc()
            if guard:
                local.depth = 0
                _nesting(-1)
                if nested_op:
                    numel, local.nested = local.nested or 0, None
            try:
                record(seq, t, numel, group, gid, peer, async_op, dev, start, end, None, True, ev0)
            except Exception as exc:  # noqa: BLE001
                fail("record", exc)
            raise
        end = pc()
        if guard:
            local.depth = 0
            _nesting(-1)
            if nested_op:
                numel, local.nested = local.nested, None
        queued = queue is not None and len(queue) > before
        if queued and pg in COALESCING:  # the wrapped manager records the coalesced op once
            span = COALESCING[pg]
            if not span:
                span.append(start)  # the coalesced row is timed from the first queued call
            pending.pop(seq, None)
            return result
        try:
            record(seq, t, numel, group, gid, peer, async_op, dev, start, end, result, False, ev0, queued)
        except Exception as exc:  # noqa: BLE001
            fail("record", exc)
        return result

    slow_test = "async_op or coalescing"
    if not leaf:
        slow_test = "True"
    elif target.tensor is not None or target.size[0] == "p2p":
        # a tensor subclass re-enters the wrapper through torch's __torch_function__ handling:
        # the slow path guards that. Tensors on an accelerator are timed there: the device test
        # (~30 ns) runs only once a process group exists in a process that has an accelerator.
        device_test = "" if host_only else " or (state.devices and not t.is_cpu)"
        slow_test += f" or (t is not None and (t.__class__ is not Tensor{device_test}))"
    dtype_code = (
        "dtype_ids.get(t.dtype) or log.dtype_id(t.dtype)"
        if target.tensor is not None
        else str(log.dtype_id(no_tensor_dtype))
    )
    watch_enter = "\n    pending[seq] = Pending(code, gid, numel, get_ident(), start, None)" if watch else ""
    watch_exit = "\n    pending.pop(seq, None)" if watch else ""
    sig = signature_source(orig)
    if sig is not None:
        params, call, args, kwargs, defaults = sig
        read_lines = reader_lines(target, orig, direct=True)
    else:
        params, call, args, kwargs, defaults = "*args, **kwargs", "*args, **kwargs", "args", "kwargs", {}
        read_lines = reader_lines(target, orig)

    def indented(lines):
        return "\n".join(" " * 8 + ln for ln in lines)

    def body(lines):
        return _BODY.format(
            slow_test=slow_test,
            dtype_code=dtype_code,
            watch_enter=watch_enter,
            watch_exit=watch_exit,
            watch_exit_err=watch_exit.replace("\n", "\n    "),
            call=call,
            args=args,
            kwargs=kwargs,
            read=indented(lines),
        )

    head = _HEAD.format(name=target.name, params=params, call=call, args=args, kwargs=kwargs)
    c_call = None
    if sig is not None and leaf and not watch:
        c_call = hot_call(
            log,
            CHUNK_MASK,
            code,
            orig,
            maintain,
            coalescing,
            Tensor,
            -1 if target.tensor is not None else log.dtype_id(no_tensor_dtype),
            not host_only and target.tensor is not None,
        )
    if c_call is None:
        source = head + body(read_lines)
    else:
        lazy = "numel = t.numel()" in read_lines  # one tensor: the C recorder reads its count
        c_read = [ln for ln in read_lines if not (lazy and ln == "numel = t.numel()")]
        c_read = [ln for ln in c_read if not re.fullmatch(r"(\w+) = \1", ln)]  # group = group
        if all(re.fullmatch(r"\w+ = (\w+|-?\d+)", ln) for ln in c_read):  # names: cannot raise
            reads = "".join("\n    " + ln for ln in c_read)
        else:
            reads = _C_READ.format(read=indented(c_read), call=call)
        source = _C_HEAD.format(
            name=target.name,
            params=params,
            read=reads,
            call=call,
            args=args,
            kwargs=kwargs,
            numel_c="None" if lazy else "numel",
        ) + body(["numel = t.numel()" if lazy else "pass"])
    ns = dict(
        state=state,
        local=local,
        orig=orig,
        inner=inner,
        slow=slow,
        group_ids=log.group_ids,
        log=log,
        next_seq=next_seq,
        fail=fail,
        pc=pc,
        error_row=error_row,
        code=code,
        extend=log.buf.extend,
        pack=ROW.pack,
        dtype_ids=log.dtype_ids,
        HOST=T_HOST << T_SHIFT,
        CHUNK_MASK=CHUNK_MASK,
        maintain=maintain,
        coalescing=coalescing,
        group_peer=group_peer,
        pending=pending,
        get_ident=get_ident,
        Pending=Pending,
        Tensor=Tensor,
        call=c_call,
        SLOW=SLOW,
        **defaults,
    )
    exec(compile(source, f"<commpatch wrapper {target.name}>", "exec"), ns)  # noqa: S102 - from the table
    wrapper = ns[target.name]
    functools.update_wrapper(wrapper, orig)
    setattr(wrapper, MARK, orig)
    return wrapper


PENDING_TIMINGS = (T_FUTURE, T_DEVICE, T_NCCL)


def _issue_stack(limit: int = 24) -> tuple:
    """Where an async call was issued (the watchdog's dump needs it after the thread moved on):
    (file, line, function) per frame, outermost first, from the wrapper out. Source lines are
    read only if the call gets stuck (``traceback.format_stack`` here cost ~60 us a call)."""
    frame, out = sys._getframe(3), []  # skip this function, record() and slow()
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    out.reverse()
    return tuple(out)


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


def after_fork() -> None:
    """A fresh lock in a forked child (the parent's may have been held by another thread)."""
    global _nesting_lock
    _nesting_lock = threading.Lock()


def _nesting(delta: int) -> None:
    """Count nesting ops running in any thread (the fast path's cheap hint to check LOCAL.depth)."""
    with _nesting_lock:
        _runtime.STATE.nesting += delta


def _coalesce_group(group):
    if group is None:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
    return group


def _coalesce_state():
    """torch's dict of groups currently inside ``_coalescing_manager`` (empty almost always)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return _world.pg_coalesce_state
    except Exception:  # noqa: BLE001 - older torch: no coalescing manager state
        return {}
