"""Module attribution on a DDP model: a submodule's forward collective, DDP's backward buckets,
an optimizer step's collective and a barrier outside all of them, and
``commpatch.summary(by=("module", "phase"))`` over those rows; the profiler as witness."""

from collections import Counter

import pytest

from tests import integration_workers as w
from tests.multiproc import run_ranks

DDP = "DistributedDataParallel"


@pytest.fixture(scope="module")
def run():
    return run_ranks(w.module_attribution, 2, timeout=90)


def test_rows_name_module_and_phase(run):
    for df, witness, _, errors in run:
        assert not errors
        assert w.claimed_counts(df) == witness
        got = Counter(zip(df["op"].astype(str), df["module"].astype(str), df["phase"].astype(str)))
        assert got == {
            ("ddp_verify_params_allgather", "", "other"): 1,
            ("ddp_verify_params_broadcast", "", "other"): 1,
            ("ddp_broadcast_coalesced", "", "other"): 1,
            ("all_reduce", "module.0", "forward"): 2,  # the submodule's own forward (FQN under DDP)
            ("ddp_rebuild_buckets_broadcast", DDP, "forward"): 2,  # before the 2nd forward
            ("ddp_bucket_allreduce", DDP, "backward"): 2,
            ("all_reduce", "ClipSGD", "optimizer"): 2,  # named by the optimizer's class
            ("barrier", "", "other"): 1,
        }


def test_summary_by_module_and_phase(run):
    for df, _, summary, _ in run:
        keyed = {(r.module, r.phase): r for r in summary.itertuples()}
        assert set(keyed) == {
            ("", "other"),
            ("module.0", "forward"),
            (DDP, "forward"),
            (DDP, "backward"),
            ("ClipSGD", "optimizer"),
        }
        for (module, phase), r in keyed.items():
            rows = df[(df["module"] == module) & (df["phase"] == phase)]
            assert r.count == len(rows) and r.bytes == rows["bytes"].sum()
        assert keyed[("module.0", "forward")].bytes == 2 * 8 * 4  # an 8-float statistic per step
        assert keyed[("ClipSGD", "optimizer")].bytes == 2 * 4
        assert keyed[(DDP, "backward")].bytes == 2 * (8 * 8 + 8 + 8 * 4 + 4) * 4  # every parameter per step
        assert summary["time_share"].sum() == pytest.approx(1.0)


# ---- torch.compile and unusual modules (one process, fake backend) ---------------------------


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("when", ["before", "after"])
def test_compiled_model_runs_and_computes_the_same(when, fullgraph):
    """The issue's reproducer: global module hooks made dynamo fail ("already tracked for
    mutation") on the first compiled call, whether enabled before or after compiling."""
    import warnings

    import torch
    import torch._dynamo

    import commpatch

    x = torch.randn(4, 8)
    plain = _mlp()
    torch._dynamo.reset()
    expected = torch.compile(plain, backend="aot_eager", fullgraph=fullgraph)(x)
    expected.sum().backward()

    model = _mlp()
    torch._dynamo.reset()
    if when == "before":
        commpatch.enable(output="none")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    if when == "after":
        commpatch.enable(output="none")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*global hooks")  # torch's warning for global hooks
        out = compiled(x)
        out.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(plain)))
    from commpatch.integrations import modules

    assert modules._stack == []
    torch._dynamo.reset()


def test_dynamo_compiles_no_frame_of_commpatch():
    """Issue 23: ``module.compile()`` compiles the bound ``_call_impl``, commpatch's wrapper, and
    dynamo traced it (and through it what torch never traces there: FSDP2's dynamo-disabled hook;
    the 2-rank cell is in test_transparency.py). No frame of commpatch is compiled, whether it is
    the compiled function itself or runs under a compiled one after a graph break (``code_of``
    at a module's first call); where dynamo inlines the wrapper it traces torch's own."""
    import torch
    import torch._dynamo
    from torch._dynamo import convert_frame

    import commpatch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x).relu()

    torch.manual_seed(0)
    x, plain = torch.randn(2, 4), Block()
    torch._dynamo.reset()
    expected = torch.compile(plain, backend="eager")(x)
    torch._dynamo.reset()
    commpatch.enable(output="none")
    block = Block()
    block.load_state_dict(plain.state_dict())
    block.compile(backend="eager")
    got = block(x)
    traced = {(c.co_name, c.co_filename) for c in (ref() for ref in convert_frame.input_codes.seen) if c is not None}
    commpatch.disable()
    torch._dynamo.reset()
    assert torch.equal(got, expected)
    ours = sorted(name for name, filename in traced if filename.startswith(commpatch.__path__[0]))
    assert not ours, f"dynamo traced frames of commpatch: {ours}"
    assert ("forward", __file__) in traced


def test_compiled_module_collectives_name_the_compiled_module():
    """A compiled module's eager collectives (here one dynamo leaves to eager code) are attributed
    to the module it compiles, by its class name, not to 'OptimizedModule'."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    import commpatch
    from tests.fakepg import fake_world

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            torch._dynamo.disable(dist.all_reduce)(y)  # looked up at call time: the wrapper
            return y

    with fake_world(2):
        commpatch.enable(output="none")
        torch._dynamo.reset()
        torch.compile(Net(), backend="eager")(torch.ones(2, 4))
        df = commpatch.log()
    assert df["module"].astype(str).tolist() == ["Net"] and df["phase"].astype(str).tolist() == ["forward"]
    torch._dynamo.reset()


def test_module_with_eq_but_no_hash_runs():
    """A module defining __eq__ without __hash__ is unhashable: attribution keys modules by identity."""
    import torch
    import torch.distributed as dist

    import commpatch
    from tests.fakepg import fake_world

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def __eq__(self, other):
            return isinstance(other, Odd)

        def forward(self, x):
            y = self.lin(x)
            dist.all_reduce(y)
            return y

    outer = torch.nn.ModuleDict({"odd": Odd()})
    with fake_world(2):
        commpatch.enable(output="none")
        outer["odd"](torch.ones(2, 4)).sum().backward()
        df = commpatch.log()
    assert df["module"].astype(str).tolist() == ["Odd"]


def test_forward_hooks_are_attributed_to_their_module_and_a_raise_restores_the_parent():
    """nn.Module._call_impl is wrapped (no global module hooks, issue 15): a module's own forward
    pre-hook runs inside its attribution, and a forward that raises restores the enclosing module."""
    import torch
    import torch.distributed as dist

    import commpatch
    from tests.fakepg import fake_world

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.boom = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), Boom()

        def forward(self, x):
            try:
                self.boom(x)
            except ValueError:
                dist.all_reduce(torch.ones(1))  # back in Outer after the raise
            return self.second(self.first(x))

    model = Outer()
    model.second.register_forward_pre_hook(lambda mod, args: dist.all_reduce(torch.ones(1)))
    with fake_world(2):
        commpatch.enable(output="none")
        model(torch.ones(1, 2))
        dist.all_reduce(torch.ones(1))  # outside any module
        df = commpatch.log()
    assert list(zip(df["module"].astype(str), df["phase"].astype(str))) == [
        ("Outer", "forward"),
        ("second", "forward"),
        ("", "other"),
    ]
    assert not any(h for h in torch.nn.modules.module._global_forward_hooks.values())
