"""Module attribution: which nn.Module, in which phase, issued each call.

``nn.Module._call_impl`` is wrapped to keep ``STATE.where`` (module code << 2 | phase) up to
date; the wrapper copies that one int into each row, and names are resolved only when the
DataFrame is built.

- forward:   the wrapped ``_call_impl`` saves ``STATE.where``, sets it for the module and restores
             it when the call returns or raises; the innermost module wins, its own forward
             hooks included. Names are fully qualified relative to the outermost module (named
             by its class), assigned once per root by walking ``named_modules()``.
- backward:  a pre-hook on the grad_fn of the root's output marks the backward of that root
             (module = the root; per-submodule backward attribution would need hooks on every
             module's tensors, as CommDebugMode's ModTracker does, at a cost on every op);
             an engine callback resets it when the backward ends.
- optimizer: global optimizer step pre/post hooks.
Cost is one Python frame per module call, not per collective. Global module hooks, used before
(issue 15), cost more: their mere presence sends every module call down torch's slow hook path
(~1.5 us per call for a no-op pair). ``COMMPATCH_MODULES=0`` turns it off.

torch.compile: dynamo never traces the wrapper (``base.invisible_to_dynamo``). Where it inlines
a module call into a graph it traces torch's own ``_call_impl`` instead (``fullgraph=True`` still
holds; it no longer short-circuits ``_call_impl`` to ``forward``, as for a module with hooks), and
it never compiles a frame of the wrapper: ``module.compile()`` (torchtitan's per-block compile)
compiles the bound ``_call_impl``, i.e. the wrapper, which then runs eagerly and dynamo starts in
torch's ``_call_impl``, as without commpatch (skipped, its hooks run eagerly, ``forward``
compiled). Tracing the wrapper instead reached hooks torch never traces there (FSDP2's
dynamo-disabled pre-forward hook: ``Unsupported`` under ``fullgraph=True``, issue 23). While a
frame is being traced or AOT-compiled (``torch.compiler.is_compiling()``) it calls the original.
A compiled module's collectives are attributed to the compiled module as a whole: the
``OptimizedModule``'s own call runs eagerly (it is named after the module it compiles).

Modules are keyed by identity, never by ``hash()``: a module may define ``__eq__`` without
``__hash__``.
"""

from __future__ import annotations

import weakref

from ..data.schema import P_BACKWARD, P_FORWARD, P_OPTIMIZER, pack_where
from ..record import state as _runtime
from .base import Integration, Needs, invisible_to_dynamo, when_imported


class _Codes:
    """module -> MODULES index, by identity (``id``), forgotten when the module is collected."""

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def get(self, module):
        return self.by_id.get(id(module))

    def __contains__(self, module) -> bool:
        return id(module) in self.by_id

    def __getitem__(self, module) -> int:
        return self.by_id[id(module)]

    def __setitem__(self, module, code: int) -> None:
        key = id(module)
        try:
            self._refs[key] = weakref.ref(module, lambda _r, key=key: self._forget(key))
        except TypeError:  # not weak-referenceable: kept for the process's life
            pass
        self.by_id[key] = code

    def _forget(self, key: int) -> None:
        self.by_id.pop(key, None)
        self._refs.pop(key, None)


_codes = _Codes()
_stack: list[int] = []  # STATE.where before each module call in progress
_in_optimizer: list[int] = []  # STATE.where before each optimizer step in progress
_handles: list = []


def wanted(settings: dict) -> bool:
    return settings.get("modules", True)


def _root_name(module) -> str:
    return type(module).__name__


def code_of(module) -> int:
    """MODULES index of a module, naming the whole tree under it on first sight. A compiled
    module (``OptimizedModule``) shares the code of the module it compiles."""
    code = _codes.get(module)
    if code is None:
        compiled = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" else None
        root = module if compiled is None else compiled
        for name, sub in _named_modules(root):
            if sub not in _codes:
                _codes[sub] = _runtime.module_id(name or _root_name(root))
        code = _codes[root]
        if compiled is not None:
            _codes[module] = code
    return code


def _named_modules(root):
    """``named_modules()`` with an identity memo: torch's own uses a set of modules (hashing)."""
    seen, todo = set(), [("", root)]
    while todo:
        name, module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module
        children = [(f"{name}.{k}" if name else k, m) for k, m in module._modules.items() if m is not None]
        todo.extend(reversed(children))


def where(module, phase: int) -> int:
    return pack_where(code_of(module), phase)


def apply(ctx) -> None:
    # enable() may run while torch itself is still importing (activation by environment):
    # install once torch.compiler (imported after torch.optim in torch's own __init__) is there.
    when_imported("torch.compiler", _install)


def _install(ctx, compiler) -> None:
    import torch
    import torch.optim.optimizer as optim_module
    from torch.nn.modules import module as nn_module

    state = _runtime.STATE
    stack = _stack
    in_optimizer = _in_optimizer
    codes = _codes
    engine = torch.autograd.Variable._execution_engine
    compiling = compiler.is_compiling

    by_id = codes.by_id
    grad_enabled = torch.is_grad_enabled

    def wrap_call_impl(orig):
        def _call_impl(module, *args, **kwargs):
            # one Python frame per module call instead of global forward hooks, whose mere presence
            # sends every module call down torch's slow hook path (~1.5 us each)
            if compiling():
                return orig(module, *args, **kwargs)
            code = by_id.get(id(module))
            if code is None:
                code = code_of(module) if not stack else _child_code(module)
            previous = state.where
            stack.append(previous)
            if code >= 0:
                state.where = (code << 2) | P_FORWARD  # pack_where inlined: this runs per module call
            try:
                output = orig(module, *args, **kwargs)
            finally:
                stack.pop()
                state.where = previous
            if not stack and grad_enabled():
                _mark_backward(module, output)
            return output

        return invisible_to_dynamo(_call_impl, orig)  # see the module's docstring (torch.compile)

    def _mark_backward(module, output):
        node = _grad_fn(output)
        code = codes.get(module)
        if node is None or code is None or code < 0:
            return
        marker = pack_where(code, P_BACKWARD)

        def begin(grad_outputs):
            previous = state.where
            state.where = marker

            def end():
                state.where = previous

            engine.queue_callback(end)

        node.register_prehook(begin)

    def optim_pre(optimizer, args, kwargs):
        if compiling():
            return
        in_optimizer.append(state.where)
        state.where = pack_where(_optimizer_code(optimizer), P_OPTIMIZER)

    def optim_post(optimizer, args, kwargs):
        if compiling():
            return
        state.where = in_optimizer.pop() if in_optimizer else 0

    ctx.patches.wrap(nn_module.Module, "_call_impl", wrap_call_impl)
    _handles.extend(
        (
            optim_module.register_optimizer_step_pre_hook(optim_pre),
            optim_module.register_optimizer_step_post_hook(optim_post),
        )
    )


def remove(ctx) -> None:
    while _handles:
        _handles.pop().remove()
    _stack.clear()
    _in_optimizer.clear()
    _runtime.STATE.where = 0


def _child_code(module) -> int:
    """A module first seen inside another one's forward (built on the fly): named by its class.
    The fx GraphModules that a compiled region runs (aot_eager and similar backends) are not the
    user's modules: their calls keep the enclosing module (code -1)."""
    import torch.fx

    if isinstance(module, torch.fx.GraphModule):
        code = -1
    else:
        code = _runtime.module_id(type(module).__name__)
    _codes[module] = code
    return code


_optim_codes: dict[type, int] = {}


def _optimizer_code(optimizer) -> int:
    cls = type(optimizer)
    code = _optim_codes.get(cls)
    if code is None:
        code = _optim_codes[cls] = _runtime.module_id(cls.__name__)
    return code


def _grad_fn(output):
    """grad_fn of the first tensor in a module's output that has one."""
    import torch

    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, (list, tuple)):
        items = output
    elif isinstance(output, dict):
        items = output.values()
    else:
        return None
    for item in items:
        node = _grad_fn(item) if isinstance(item, (torch.Tensor, list, tuple, dict)) else None
        if node is not None:
            return node
    return None


INTEGRATION = Integration(
    name="modules",
    patches="torch.nn.Module._call_impl (a wrapper), global optimizer step pre/post hooks, a grad_fn pre-hook per "
    "root output",
    relies_on=(
        Needs("torch.nn.Module._call_impl"),
        Needs("torch.nn.Module._wrapped_call_impl"),
        Needs("torch.optim.optimizer.register_optimizer_step_pre_hook", "the optimizer phase"),
        Needs("torch.optim.optimizer.register_optimizer_step_post_hook", "the optimizer phase"),
        Needs("torch.autograd.Variable._execution_engine.queue_callback"),
        Needs("torch.compiler.is_compiling"),
        Needs("torch._dynamo.eval_frame.skip_code"),
    ),  # invisible_to_dynamo: never a compiled frame
    records="the module and phase of each call",
    wanted=wanted,
    apply=apply,
    remove=remove,
)
