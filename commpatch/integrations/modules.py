"""Module attribution: which nn.Module, in which phase, issued each call.

Global module hooks keep ``STATE.where`` (module code << 2 | phase) up to date; the wrapper
copies that one int into each row, and names are resolved only when the DataFrame is built.

- forward:   global forward pre/post hooks keep a stack; the innermost module wins. Names are
             fully qualified relative to the outermost module (named by its class), assigned once
             per root by walking ``named_modules()``.
- backward:  a pre-hook on the grad_fn of the root's output marks the backward of that root
             (module = the root; per-submodule backward attribution would need hooks on every
             module's tensors, as CommDebugMode's ModTracker does, at a cost on every op);
             an engine callback resets it when the backward ends.
- optimizer: global optimizer step pre/post hooks.
Cost is per module call (two Python hooks), not per collective; ``COMMPATCH_MODULES=0`` turns
it off.

torch.compile: every hook returns at once while a frame is being compiled
(``torch.compiler.is_compiling()``, which dynamo folds to a constant), so dynamo traces nothing
of commpatch into a graph and ``fullgraph=True`` still holds (a hook that touched the module
made dynamo fail with "already tracked for mutation"). A compiled module's collectives are
attributed to the compiled module as a whole: the ``OptimizedModule``'s own hooks run eagerly
(it is named after the module it compiles). torch warns at every call of a compiled module
when global hooks exist ("hooks fire an extra time"): ``_has_any_global_hook`` is wrapped so
that commpatch's own hooks, which expect that, do not count.

Modules are keyed by identity, never by ``hash()``: a module may define ``__eq__`` without
``__hash__``.
"""

from __future__ import annotations

import weakref

from ..data.schema import P_BACKWARD, P_FORWARD, P_OPTIMIZER, pack_where
from ..record import state as _runtime
from .base import Integration, when_imported


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
        except TypeError:            # not weak-referenceable: kept for the process's life
            pass
        self.by_id[key] = code

    def _forget(self, key: int) -> None:
        self.by_id.pop(key, None)
        self._refs.pop(key, None)


_codes = _Codes()
_stack: list[tuple[int, int]] = []        # (id of the module, STATE.where before it)
_handles: list = []
_hidden: list = []                         # (module, original _has_any_global_hook)


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
    codes = _codes
    engine = torch.autograd.Variable._execution_engine
    compiling = compiler.is_compiling

    def forward_pre(module, args):
        if compiling():
            return
        code = codes.get(module)
        if code is None:
            code = code_of(module) if not stack else _child_code(module)
        stack.append((id(module), state.where))
        if code >= 0:
            state.where = (code << 2) | P_FORWARD     # pack_where inlined: this runs per module call

    def forward_post(module, args, output):
        if compiling() or not stack:
            return
        key = id(module)
        if stack[-1][0] != key:
            # a pre-hook that ran without its post-hook (an exception, or a graph break between
            # them): unwind to this module's entry, or leave the stack alone if it has none
            if not any(entry[0] == key for entry in stack):
                return
            while stack[-1][0] != key:
                stack.pop()
        state.where = stack.pop()[1]
        if not stack and torch.is_grad_enabled():
            _mark_backward(module, output)

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
        stack.append((id(optimizer), state.where))
        state.where = pack_where(_optimizer_code(optimizer), P_OPTIMIZER)

    def optim_post(optimizer, args, kwargs):
        if compiling():
            return
        state.where = stack.pop()[1] if stack else 0

    module_handles = (nn_module.register_module_forward_pre_hook(forward_pre),
                      nn_module.register_module_forward_hook(forward_post, always_call=True))
    _handles.extend(module_handles + (
        optim_module.register_optimizer_step_pre_hook(optim_pre),
        optim_module.register_optimizer_step_post_hook(optim_post),
    ))
    _hide_own_hooks(nn_module, module_handles)


def _hide_own_hooks(nn_module, handles) -> None:
    """torch.compile(module) warns at every call when any global module hook exists; commpatch's
    hooks expect to run for the OptimizedModule too, so they do not count as "any"."""
    orig = getattr(nn_module, "_has_any_global_hook", None)
    if orig is None or _hidden:
        return
    ours = {h.id for h in handles}
    names = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
             "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")

    def _has_any_global_hook():
        # every registry is keyed by the hook's handle id
        return any(key not in ours for name in names for key in getattr(nn_module, name, {}))

    _has_any_global_hook.__wrapped__ = orig
    nn_module._has_any_global_hook = _has_any_global_hook
    _hidden.append((nn_module, orig))


def remove(ctx) -> None:
    while _handles:
        _handles.pop().remove()
    while _hidden:
        nn_module, orig = _hidden.pop()
        nn_module._has_any_global_hook = orig
    _stack.clear()
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
    patches="global nn.Module forward pre/post hooks, optimizer step pre/post hooks, a grad_fn pre-hook per root "
            "output, torch.nn.modules.module._has_any_global_hook",
    relies_on=("torch.nn.modules.module.register_module_forward_pre_hook / _hook",
               "torch.optim.optimizer.register_optimizer_step_pre_hook / post_hook",
               "torch.nn.modules.module._has_any_global_hook", "Variable._execution_engine.queue_callback",
               "torch.compiler.is_compiling"),
    wanted=wanted, apply=apply, remove=remove)
