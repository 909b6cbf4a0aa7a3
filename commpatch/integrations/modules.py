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
"""

from __future__ import annotations

import weakref

from .. import _runtime
from .._runtime import P_BACKWARD, P_FORWARD, P_OPTIMIZER
from . import when_imported

_codes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # module -> MODULES index
_stack: list[int] = []
_handles: list = []


def wanted(settings: dict) -> bool:
    return settings.get("modules", True)


def code_of(module) -> int:
    """MODULES index of a module, naming the whole tree under it on first sight."""
    code = _codes.get(module)
    if code is None:
        for name, sub in module.named_modules():
            if sub not in _codes:
                _codes[sub] = _runtime.module_id(name or type(module).__name__)
        code = _codes[module]
    return code


def where(module, phase: int) -> int:
    return (code_of(module) << 2) | phase


def apply(ctx) -> None:
    # enable() may run while torch itself is still importing (activation by environment):
    # install once torch.optim (imported late in torch's own __init__) is there.
    when_imported("torch.optim.optimizer", _install)


def _install(ctx, optim_module) -> None:
    import torch
    from torch.nn.modules import module as nn_module

    state = _runtime.STATE
    stack = _stack
    codes = _codes
    engine = torch.autograd.Variable._execution_engine

    def forward_pre(module, args):
        code = codes.get(module)
        if code is None:
            code = code_of(module) if not stack else _child_code(module)
        stack.append(state.where)
        state.where = (code << 2) | P_FORWARD

    def forward_post(module, args, output):
        if stack:
            state.where = stack.pop()
            if not stack and torch.is_grad_enabled():
                _mark_backward(module, output)

    def _mark_backward(module, output):
        node = _grad_fn(output)
        if node is None:
            return
        marker = (codes[module] << 2) | P_BACKWARD

        def begin(grad_outputs):
            previous = state.where
            state.where = marker

            def end():
                state.where = previous

            engine.queue_callback(end)

        node.register_prehook(begin)

    def optim_pre(optimizer, args, kwargs):
        stack.append(state.where)
        state.where = P_OPTIMIZER | (_optimizer_code(optimizer) << 2)

    def optim_post(optimizer, args, kwargs):
        state.where = stack.pop() if stack else 0

    _handles.extend((
        nn_module.register_module_forward_pre_hook(forward_pre),
        nn_module.register_module_forward_hook(forward_post, always_call=True),
        optim_module.register_optimizer_step_pre_hook(optim_pre),
        optim_module.register_optimizer_step_post_hook(optim_post),
    ))


def remove(ctx) -> None:
    while _handles:
        _handles.pop().remove()
    _stack.clear()
    _runtime.STATE.where = 0


def _child_code(module) -> int:
    """A module first seen inside another one's forward (built on the fly): named by its class."""
    code = _codes[module] = _runtime.module_id(type(module).__name__)
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
