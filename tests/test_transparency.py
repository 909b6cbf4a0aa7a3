"""Transparency matrix: commpatch changes nothing a training job computes.

Cells: model kind × compile mode × when commpatch is enabled × module attribution.

- kind: ``plain`` (no parallelism, no collective, still inside the 2-rank gloo group), ``ddp``
  (DistributedDataParallel, default buckets), ``fsdp2`` (``fully_shard`` per Linear and
  the root), ``tp`` (ColwiseParallel / RowwiseParallel via ``parallelize_module`` on a 1-D
  DeviceMesh of the 2 ranks). The model: Linear(8, 16), ReLU, Linear(16, 8); 3 steps of SGD.
- compile: ``eager``; ``compile`` = ``torch.compile(backend="aot_eager")``; ``fullgraph`` = the
  same with ``fullgraph=True``; ``inductor`` = ``torch.compile()`` (default backend), two cells
  per kind to cover inductor.
- when: ``before`` = ``commpatch.enable()`` before the model is built (every step recorded);
  ``after`` = after the model was built, wrapped, compiled and ran its first step (which is when
  torch.compile actually compiles): steps 1-2 run with commpatch enabled over a compiled model.
- modules: ``commpatch.enable(output="none", modules=True / False)`` (``COMMPATCH_MODULES=1 / 0``).

Each cell must run, end with no internal error of commpatch, and give losses, gradients (local
shards for FSDP2 / TP) and final parameters bit-identical (``torch.equal``) to a baseline run
of the same compile mode in the same process with commpatch never enabled (same seeds).
Eager cells of a kind that communicates must also have recorded its collectives (DDP bucket
all-reduces, FSDP2 all-gathers and reduce-scatters, TP's functional all-reduce), at least one
per recorded step, and the plain model none at all. ``torch._dynamo.reset()`` runs between cells.

- ``blocks`` (fsdp2 only): torchtitan's way, ``fully_shard`` on each block (two blocks of a class
  of the test's own, then the root) and ``block.compile(backend="aot_eager", fullgraph=True)``
  per block. Issue 23: commpatch made it crash (dynamo compiled commpatch's ``_call_impl``
  wrapper and reached FSDP2's dynamo-disabled hook). Its ``before`` cells run under
  torch.profiler: commpatch's counts and bytes per collective must equal the ``gloo:`` events'.

Excluded cells (they fail without commpatch too, torch 2.13 CPU / gloo, measured):

- ``ddp-fullgraph-*``: DDP's forward graph-breaks in ``_pre_forward`` (dynamo: "Unsupported
  method call ... `set_runtime_stats_and_log` of class `Logger`"), and DDPOptimizer splits the
  graph at bucket boundaries anyway.
- ``fsdp2-fullgraph-*``: FSDP2's forward pre-hook calls ``torch._dynamo.disable`` (dynamo:
  "Attempted to call function marked as skipped").

Inductor cells are only ``before`` / ``after`` with modules on, per kind, and marked slow (the
inductor baseline is the slowest part of each run); the modules-off ones are left out for time.
FSDP2 with ``torch.compile`` without ``fullgraph`` works on CPU (aot_eager and inductor; FSDP's
hooks run eagerly around the compiled regions, so its rows are recorded), as does TP with
``fullgraph=True`` (its functional collectives are then in the graph: not recorded). DDP needs
its default bucket cap under torch.compile (DDPOptimizer asserts its 1 MiB first bucket is not
larger than the others), so the DDP model has one bucket.

One multi-process run per kind (world size 2) runs the selected cells of that kind, so that
``-m "not slow"`` also shortens the runs; each test reports one cell. Idle 2-core machine: about
45 s for the file, 28 s with ``-m "not slow"`` (under heavy load from other jobs, 2-3x that).
"""

import sys

import pytest

from tests import transparency_workers as w
from tests.multiproc import run_ranks
from tests.torch_compat import leaf

EXCLUDED = {("ddp", "fullgraph"), ("fsdp2", "fullgraph")} | {(k, "blocks") for k in w.KINDS if k != "fsdp2"}
# inductor: these cells only (compiles are slow on 2 cores); aot_eager covers the whole product
INDUCTOR = {("before", "modules_on"), ("after", "modules_on")}
# what each kind must have recorded in its eager cells (at least one row per recorded step)
EAGER_OPS = {
    "plain": (),
    "ddp": ("ddp_bucket_allreduce",),
    # FSDP2 calls all_gather_into_tensor / reduce_scatter_tensor; a torch that has the *_single
    # functions implements them through those (the innermost call is recorded): torch 2.8 and 2.11 not
    "fsdp2": (leaf("all_gather_into_tensor"), leaf("reduce_scatter_tensor")),
    "tp": ("funcol.all_reduce",),
}
RUN_TIMEOUT = 240  # seconds for one kind's run (11-16 s on an idle 2-core machine)

# the first test of a kind also runs the kind's run (its fixture): more than pyproject.toml's 180 s
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 60)


def _cells():
    cells = {}
    for kind in w.KINDS:
        for mode in w.COMPILES:
            if (kind, mode) in EXCLUDED:
                continue
            for when in w.WHENS:
                for modules in w.MODULES:
                    if mode == "inductor" and (when, modules) not in INDUCTOR:
                        continue
                    cells[w.cell_name(kind, mode, when, modules)] = (kind, mode, when, modules)
    return cells


CELLS = _cells()


def _slow(kind, mode, when, modules) -> bool:
    """Inductor cells: the inductor baseline alone takes 2-11 s of each run (TP the most)."""
    return mode == "inductor"


def _selected(session) -> set:
    """The cells of this file that this session runs (after -k / -m deselection)."""
    names = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is sys.modules[__name__] and callspec and "cell" in callspec.params:
            names.add(callspec.params["cell"])
    return names


@pytest.fixture(scope="module")
def runs(request):
    """``runs(kind)``: each rank's result of the one run of ``kind`` (run on first use)."""
    selected = _selected(request.session)
    cache = {}

    def get(kind):
        if kind not in cache:
            cells = [CELLS[name][1:] for name in CELLS if CELLS[name][0] == kind and name in selected]
            try:
                cache[kind] = run_ranks(
                    w.transparency, 2, timeout=RUN_TIMEOUT, pg_timeout=w.PG_TIMEOUT, kind=kind, cells=cells
                )
            except AssertionError as exc:  # a rank died or the run timed out: every cell of it fails
                cache[kind] = exc
        if isinstance(cache[kind], BaseException):
            pytest.fail(f"the {kind} run failed:\n{cache[kind]}", pytrace=False)
        return cache[kind]

    return get


@pytest.mark.parametrize(
    "cell", [pytest.param(name, id=name, marks=[pytest.mark.slow] if _slow(*c) else []) for name, c in CELLS.items()]
)
def test_cell(runs, cell):
    kind, mode, when, modules = CELLS[cell]
    if kind == "fsdp2":
        from tests.torch_compat import fsdp2_cpu_unsupported

        if fsdp2_cpu_unsupported():
            pytest.skip(fsdp2_cpu_unsupported())
    problems, traces = [], []
    for rank, res in enumerate(runs(kind)):
        r = res["cells"][cell]
        if not r["ok"]:
            problems.append(f"rank {rank}: {r['error']}")
            if r["trace"] and not traces:
                traces.append(f"rank {rank}:\n{r['trace']}")
            continue
        if r["differences"]:
            shown = ", ".join(r["differences"][:4]) + (", ..." if len(r["differences"]) > 4 else "")
            problems.append(f"rank {rank}: not bit-identical to the run without commpatch: {shown}")
        if r["internal_errors"]:
            problems.append(f"rank {rank}: commpatch internal errors {r['internal_errors']}")
        if "witness" in r:
            for what, (claimed, witness) in r["witness"].items():
                if claimed != witness:
                    problems.append(f"rank {rank}: {what} per collective: commpatch {claimed}, profiler {witness}")
        if mode == "eager" or mode in w.PER_BLOCK:  # FSDP2 runs its collectives eagerly around the blocks
            if kind == "plain" and r["ops"]:
                problems.append(f"rank {rank}: rows recorded for a model that issues no collective: {r['ops']}")
            for op in EAGER_OPS[kind]:
                if r["ops"].get(op, 0) < w.instrumented_steps(when):
                    problems.append(
                        f"rank {rank}: {r['ops'].get(op, 0)} {op} rows for "
                        f"{w.instrumented_steps(when)} recorded steps (recorded: {r['ops']})"
                    )
    if problems:
        pytest.fail("\n".join([f"{cell}:"] + problems + traces), pytrace=False)
