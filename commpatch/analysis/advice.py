"""Tuning advice: what to change in the job, from the measured log, each item with its evidence.

``advice(df, steps_table, cross)`` returns a list of ``Advice``, one per rule that fires. Each rule is
a small pure function over the log's rows and the analysis tables (``steps.per_step``,
``stragglers.verdict``); its thresholds are the named constants below; it gives nothing when the
evidence is weak (too few steady-state steps, a gain too small to tell from the machine's noise, a
latency that cannot be fitted). Rules:

- ``ddp_bucket_size``: DDP's last gradient bucket is large and its all-reduce, which starts only when
  the backward is over, is a large exposed tail: a smaller ``bucket_cap_mb`` splits it, so most of
  it runs under the backward.
- ``ddp_grad_copy``: DDP's finalize (its copy of the averaged gradients from the buckets into
  ``.grad``) takes a share of the step: ``gradient_as_bucket_view=True`` makes ``.grad`` a view of
  the bucket, and the copy goes.
- ``fsdp_reshard``: FSDP units that free their parameters after their forward gather them again in the
  backward, and the training thread waits for those all-gathers: FSDP2 ``reshard_after_forward=False``,
  FSDP1 ``sharding_strategy=SHARD_GRAD_OP``.
- ``small_messages``: many calls per step on one group below the latency-bound size (where a call's
  fixed latency equals its transfer time, fitted from the group's own calls): coalesce them.
- ``straggler``: one rank late in most steady-state steps by a steady amount (the straggler
  verdict): its own compute or data loading, not the network; with its step-time breakdown.

Pure: DataFrames in, a list of ``Advice`` out (renderers word and lay them out).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..data.logfile import JOB_ATTR
from ..data.schema import expand_ranks
from . import stragglers
from .arrays import lexsort
from .steps import BLOCKING_TIMINGS, _bucket_mask, per_step, steady_rows, steady_state
from .summaries import own_durations, size_bucket, transfer_durations

# evidence: at least this many steady-state steps
MIN_STEPS = 5
# a change is advised only when its expected gain is at least this share of the median step ...
MIN_GAIN_SHARE = 0.05
# ... and at least this much per step (a loaded machine's noise on a step is of this order)
MIN_GAIN_US = 500.0

# ddp_bucket_size: the exposed tail after the last bucket's issue is at least this share of the step,
BUCKET_TAIL_SHARE = 0.10
# the advised cap splits the step's gradients into about this many buckets,
TARGET_BUCKETS = 4
# never below this (MiB; DDP's own first bucket is 1 MiB: below it per-call latency starts to count),
MIN_BUCKET_MB = 1.0
# and the last bucket is at least this many times the advised cap (else splitting it gains little).
LAST_BUCKET_FACTOR = 2.0
# The backward's length is in the log only as the span of the buckets' issues (nothing with one
# bucket): it is taken as at least this share of the step's time outside exposed communication
# (a backward costs about twice its forward), to check that the other buckets' all-reduce fits under it.
BACKWARD_SHARE = 0.5
MIB = float(1 << 20)

# ddp_grad_copy: DDP's finalize (which holds the copy back into .grad) is at least this share of the step
GRAD_COPY_SHARE = 0.03

# small_messages: at least this many calls per step below the latency-bound size on one group,
MIN_SMALL_CALLS = 8
# the latency fitted from at least this many message sizes (powers of two), each of this many calls,
MIN_SIZES = 2
MIN_CALLS_PER_SIZE = 3
# spanning at least this ratio of sizes.
MIN_SIZE_SPAN = 16.0
# with one message size in the run (no fit): calls up to this many bytes are taken as latency-bound (a
# 64 KiB message takes well under a call's fixed latency on every interconnect torch supports)
SMALL_BYTES = 64 * 1024


@dataclass
class Advice:
    """One item of advice. ``rule``: the rule's name (stable); ``title``: one line; ``evidence``: the
    measurements behind it, name -> number (units in the names: _us, _bytes, _share, _mib); ``change``:
    the exact argument or code to change; ``setting``: the same, machine-readable (argument -> value;
    {} when the change is code); ``gain_us``: expected gain per step (an estimate, not a bound: NaN when
    unknown), ``gain_share``: of the median steady-state step; ``text``: why, in a sentence or two;
    ``section``: the report table behind it."""

    rule: str
    title: str
    evidence: dict
    change: str
    setting: dict = field(default_factory=dict)
    gain_us: float = math.nan
    gain_share: float = math.nan
    text: str = ""
    section: str = "steps"

    def as_dict(self) -> dict:
        """A plain dict for JSON (NaN as None)."""

        def clean(value):
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, (float, np.floating)):
                return None if math.isnan(value) else float(value)
            if isinstance(value, np.integer):
                return int(value)
            return value

        return clean(asdict(self))


KEYS = tuple(Advice.__dataclass_fields__)


def advice(df, steps_table, cross=None, by_rank=None, job=None) -> list:
    """Every rule's advice for one run's log (``df`` with its pattern steps, as ``build_report`` has
    it; ``steps_table``: ``per_step(df, by_rank=False)``; ``cross``: ``matching.cross_rank(df)`` or
    None; ``job``: the logs' job notes, ``df.attrs["job_notes"]`` when None: step marks and the DDP /
    FSDP settings). ``df`` None (the report at scale): the straggler rule only, from ``by_rank`` (the
    engine's ``per_step(by_rank=True)``); the other rules read the rows (``ROW_RULES``). Each wait is
    attributed once (the straggler's: the others' wait for it is not also a DDP tail), and the items
    come by expected gain, the largest first (unknown gains last)."""
    if df is None and by_rank is None or df is not None and not len(df):
        return []
    if job is None and df is not None:
        job = df.attrs.get(JOB_ATTR)
    st = steady_state(steps_table)
    if st["steps"] < MIN_STEPS or not st["step_p50_us"] > 0:
        return []
    out = []
    if df is not None:
        conf = settings(job)
        for rule in (ddp_bucket_size, ddp_grad_copy, small_messages):
            out += rule(df, steps_table, st, conf)
        out += fsdp_reshard(df, steps_table, st, job)
    out += straggler(df, steps_table, st, cross, by_rank, job)
    return by_gain(out)


ROW_RULES = (
    "ddp_bucket_size",
    "ddp_tail_parameter",
    "ddp_grad_copy",
    "fsdp_reshard",
    "small_messages",
)  # rules reading every row


def by_gain(items: list) -> list:
    """Advice items ordered by expected gain per step, the largest first; unknown gains last."""
    return sorted(items, key=lambda a: (math.isnan(a.gain_us), -a.gain_us if not math.isnan(a.gain_us) else 0.0))


def settings(job, wrapper: str = "ddp") -> dict:
    """The settings a ``wrapper`` (``ddp``, ``fsdp2``) module was made with, as its first rank's log noted
    them (``integrations.ddp`` / ``fsdp``: {setting: value}); {} when the log has none (an older log,
    CSV). With several such modules, the first one's."""
    for notes in sorted(job or (), key=lambda n: n.get("rank", -1)):
        for item in notes.get("settings") or ():
            if item.get("wrapper") == wrapper:
                return dict(item.get("values") or {})
    return {}


# ---- DDP ------------------------------------------------------------------------------------------
def bucket_steps(df, steps_table):
    """Per steady-state (rank, step) with DDP gradient buckets: buckets, bucket_bytes, last_bytes and
    last_params (the bucket issued last: the end of the backward), issue_span_us (first to last issue),
    tail_us (the last issue, or the last rank's issue of it where later, to the end of DDP's finalize,
    else of the last all-reduce: exposed, and none of it a wait for a late rank), comm_us (the buckets'
    arrival-free transfer time summed), finalize_us (the end of the finalize after the last all-reduce's
    completion), pack_us (DDP's packing of the gradients into the buckets)."""
    import pandas as pd

    rows = steady_rows(df, steps_table)
    mask = _bucket_mask(rows)
    b = rows[mask]
    cols = [
        "rank",
        "step",
        "buckets",
        "bucket_bytes",
        "last_bytes",
        "last_params",
        "issue_span_us",
        "tail_us",
        "comm_us",
        "finalize_us",
        "pack_us",
    ]
    if not len(b):
        return pd.DataFrame(columns=cols)
    start_ns = b["start_ns"].to_numpy(np.int64)
    start = (start_ns - start_ns.min()).astype(np.float64) / 1e3  # us: exact enough as float
    dur = np.nan_to_num(b["duration_us"].to_numpy(np.float64))
    sync = b["sync_end_us"].to_numpy(np.float64) if "sync_end_us" in b.columns else np.full(len(b), np.nan)
    transfer = np.nan_to_num(transfer_durations(b))
    own = np.nan_to_num(own_durations(b))
    work = pd.DataFrame(
        {
            "rank": b["rank"].to_numpy(),
            "step": b["step"].to_numpy(),
            "start": start,
            "end": start + dur,
            "sync_end": start + np.nan_to_num(sync, nan=-np.inf),
            "bytes": b["bytes"].to_numpy(np.float64),
            "params": b["bucket_params"].to_numpy() if "bucket_params" in b.columns else 0,
            "comm": transfer,
            "wait": np.clip(own - transfer, 0, None),  # until the last rank issued it
            "pack": b["pack_us"].to_numpy(np.float64) if "pack_us" in b.columns else np.nan,  # NaN: not timed
        }
    )
    work = work.sort_values(["rank", "step", "start"], kind="stable")
    g = work.groupby(["rank", "step"], sort=True)
    last = g.tail(1).set_index(["rank", "step"])
    out = g.agg(
        buckets=("bytes", "size"),
        bucket_bytes=("bytes", "sum"),
        first=("start", "min"),
        end=("end", "max"),
        sync_end=("sync_end", "max"),
        comm_us=("comm", "sum"),
    )
    out["pack_us"] = g["pack"].sum(min_count=1)  # unknown where no bucket of the step has it timed
    finish = np.fmax(out["end"], out["sync_end"])
    out["last_bytes"] = last["bytes"]
    out["last_params"] = last["params"]
    out["issue_span_us"] = last["start"] - out["first"]
    out["tail_us"] = np.clip(finish - last["start"] - last["wait"], 0, None)
    out["finalize_us"] = np.clip(finish - out["end"], 0, None)
    return out.drop(columns=["first", "end", "sync_end"]).reset_index()[cols]


def _step_times(steps_table):
    """step_us per steady (rank, step): the per-step table's mean over ranks (by_rank=False) or its own."""
    cols = (
        ["rank", "step", "step_us", "exposed_us"]
        if "rank" in steps_table.columns
        else ["step", "step_us", "exposed_us"]
    )
    return steps_table.loc[steps_table["stage"] == "steady", cols]


def _tail_parameter(conf: dict, last_bytes: float, last_params: float):
    """The (name, bytes) of the parameter that makes the last bucket alone, from the DDP settings'
    first parameters (their gradients are ready last); None when the log cannot tell."""
    if round(last_params) != 1:
        return None
    for name, nbytes in conf.get("first_params") or ():
        if float(nbytes) == last_bytes:
            return str(name), float(nbytes)
    return None


def ddp_bucket_size(df, steps_table, st, conf=None) -> list:
    """A smaller ``bucket_cap_mb`` when the exposed tail is the all-reduce of one large last bucket; when
    no cap can split it (one parameter, or a cap at or below the advised one already: ``conf``, the DDP
    settings the log noted), the parameter that holds the tail is named instead (``ddp_tail_parameter``)."""
    conf = conf or {}
    bs = bucket_steps(df, steps_table)
    if bs["step"].nunique() < MIN_STEPS:
        return []
    bs = bs.merge(_step_times(steps_table), on=[c for c in ("rank", "step") if c in steps_table.columns])
    step_us = float(np.nanmedian(bs["step_us"]))
    tail_us = float(np.nanmedian(bs["tail_us"]))
    total = float(np.median(bs["bucket_bytes"]))
    last = float(np.median(bs["last_bytes"]))
    params = float(np.median(bs["last_params"]))
    comm_us = float(np.nanmedian(bs["comm_us"]))
    if not (step_us > 0 and total > 0 and comm_us > 0) or tail_us < BUCKET_TAIL_SHARE * step_us:
        return []
    us_per_byte = comm_us / total
    on_cpu = "device" in df.columns and bool((df.loc[_bucket_mask(df), "device"].astype(str) == "cpu").all())
    cap_mb = _nice_mb(max(total / TARGET_BUCKETS / MIB, MIN_BUCKET_MB))
    current = conf.get("bucket_cap_mb")
    if current is not None and cap_mb >= float(current):  # never the current setting, nor a larger one
        cap_mb = _nice_mb(float(current) / LAST_BUCKET_FACTOR)
        if cap_mb < MIN_BUCKET_MB:
            return _tail_parameter_advice(conf, bs, step_us, tail_us, last, params, us_per_byte, current, on_cpu)
    cap = cap_mb * MIB
    if last < LAST_BUCKET_FACTOR * cap or round(params) == 1:
        return _tail_parameter_advice(conf, bs, step_us, tail_us, last, params, us_per_byte, current, on_cpu)
    # the new last bucket: about the cap, or one parameter where a parameter is larger
    new_last = min(last, max(cap, last / max(params, 1.0)))
    compute_us = float(np.nanmedian(bs["step_us"] - bs["exposed_us"]))
    backward_us = max(float(np.median(bs["issue_span_us"])), BACKWARD_SHARE * compute_us)
    backlog_us = max(0.0, (total - new_last) * us_per_byte - backward_us)
    predicted_us = new_last * us_per_byte + backlog_us + float(np.nanmedian(bs["finalize_us"]))
    gain = tail_us - predicted_us
    if gain < max(MIN_GAIN_SHARE * step_us, MIN_GAIN_US):
        return []
    hidden = 1.0 - tail_us / max(float(np.nanmedian(bs["comm_us"] + bs["finalize_us"])), tail_us)
    evidence = dict(
        steps=int(bs["step"].nunique()),
        step_us=step_us,
        buckets=float(np.median(bs["buckets"])),
        bucket_bytes=total,
        last_bucket_bytes=last,
        last_bucket_params=params,
        tail_us=tail_us,
        tail_share=tail_us / step_us,
        hidden_share=max(hidden, 0.0),
        comm_us=comm_us,
        us_per_mib=us_per_byte * MIB,
        issue_span_us=float(np.median(bs["issue_span_us"])),
        backward_estimate_us=backward_us,
        predicted_tail_us=predicted_us,
        current_bucket_cap_mb=float(current) if current is not None else math.nan,
    )
    text = (
        f"the last gradient bucket ({_mb(last)} of the step's {_mb(total)}, {_n(evidence['buckets'])} bucket(s)"
        + (f", bucket_cap_mb={float(current):g}" if current is not None else "")
        + f") is all-reduced only when the backward is over: the training thread waits {_ms(tail_us)} per step "
        f"for it, counted from the last rank's issue ({_pct(tail_us / step_us)} of the {_ms(step_us)} step; "
        f"{_pct(evidence['hidden_share'])} of the buckets' time is hidden under the backward). With buckets of "
        f"{cap_mb:g} MiB the last one is about {_mb(new_last)}; at the measured {_ms(us_per_byte * MIB)} per MiB "
        f"the tail would be about {_ms(predicted_us)}, if the other buckets' all-reduce "
        f"({_ms((total - new_last) * us_per_byte)}) fits under the backward (taken as {_ms(backward_us)})."
    )
    if on_cpu:
        text += (
            " On CPU the all-reduce under the backward competes with it for the cores: on a busy machine the "
            "step gains less than the tail loses."
        )
    return [
        Advice(
            "ddp_bucket_size",
            f"DDP: buckets of {cap_mb:g} MiB to overlap the gradient all-reduce with the backward",
            evidence,
            f"DistributedDataParallel(model, bucket_cap_mb={cap_mb:g})",
            {"bucket_cap_mb": cap_mb},
            gain,
            gain / step_us,
            text,
            "steps",
        )
    ]


def _tail_parameter_advice(conf, bs, step_us, tail_us, last, params, us_per_byte, current, on_cpu) -> list:
    """The tail is one parameter's all-reduce (or a bucket the job's cap already makes as small as
    advised): no ``bucket_cap_mb`` splits it; the parameter is named, with what its bytes cost."""
    named = _tail_parameter(conf, last, params)
    if named is None and round(params) != 1:
        return []
    name, nbytes = named if named is not None else ("(not named in this log)", last)
    evidence = dict(
        steps=int(bs["step"].nunique()),
        step_us=step_us,
        tail_us=tail_us,
        tail_share=tail_us / step_us,
        last_bucket_bytes=last,
        last_bucket_params=params,
        us_per_mib=us_per_byte * MIB,
        current_bucket_cap_mb=float(current) if current is not None else math.nan,
    )
    text = (
        f"the training thread waits {_ms(tail_us)} per step ({_pct(tail_us / step_us)} of the step) for the last "
        f"gradient bucket, counted from the last rank's issue; that bucket is one parameter, {name} ({_mb(nbytes)}), "
        "the model's first, whose gradient is ready last: no bucket_cap_mb can split it"
        + (f" (the job's is {float(current):g})" if current is not None else "")
        + ". Its all-reduce can only shrink with its bytes (a compressing comm hook, freezing it, a smaller "
        "embedding); the gain depends on that change and is not predicted here."
    )
    if on_cpu:
        text += (
            " On CPU (gloo) the fp16 compression hook costs more than it saves (benchmarks/advice_loop.py: "
            "3-23 ms slower per step): freeze or shrink the parameter instead."
        )
    return [
        Advice(
            "ddp_tail_parameter",
            f"DDP: the backward's exposed tail is the all-reduce of one parameter, {name}",
            evidence,
            f"no bucket_cap_mb splits it: reduce what {name} sends (e.g. DistributedDataParallel."
            "register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook))",
            {},
            math.nan,
            math.nan,
            text,
            "steps",
        )
    ]


def ddp_grad_copy(df, steps_table, st, conf=None) -> list:
    """``gradient_as_bucket_view=True`` when DDP's finalize (which copies the averaged gradients back into
    .grad) takes a share of the step; never when the job has it. Its gain is not predicted: the log times
    the windows that hold the copies (packing, finalize), not the copies."""
    conf = conf or {}
    if conf.get("gradient_as_bucket_view"):
        return []
    bs = bucket_steps(df, steps_table)
    if bs["step"].nunique() < MIN_STEPS:
        return []
    pack_us = float(bs["pack_us"].median())  # NaN: the packing not timed (older logs, GPU models)
    finalize_us = float(np.nanmedian(bs["finalize_us"]))
    step_us = st["step_p50_us"]
    if not finalize_us >= max(GRAD_COPY_SHARE * step_us, MIN_GAIN_US):
        return []
    total = float(np.median(bs["bucket_bytes"]))
    evidence = dict(
        steps=int(bs["step"].nunique()),
        step_us=step_us,
        pack_us=pack_us,
        finalize_us=finalize_us,
        finalize_share=finalize_us / step_us,
        bucket_bytes=total,
    )
    text = (
        f"DDP copies the step's gradients ({_mb(total)}) into its buckets during the backward and back into "
        f".grad in its finalize after the last all-reduce ({_ms(finalize_us)} per step, {_pct(finalize_us / step_us)} "
        "of the step); with gradient_as_bucket_view=True .grad is a view of the bucket: the copy back goes, and "
        "the copy in (and its memory) too where .grad is kept between steps (optimizer.zero_grad(set_to_none=False)); "
        "with set_to_none=True, torch's default, each step's gradients are new tensors that DDP copies in again "
        "(gradients then alias the buckets: no .grad = None / detach_() of them by hand). The "
        f"gain is not predicted: the log times the windows that hold the copies (the packing, {'not timed' if math.isnan(pack_us) else _ms(pack_us)}, "
        "and the finalize), which also hold the reducer's hooks and the thread's wake-up after the all-reduce, "
        "not the copies (a 3.77 ms finalize once came with 0.29 ms saved)."
    )
    return [
        Advice(
            "ddp_grad_copy",
            f"DDP: gradient_as_bucket_view=True saves the copy of {_mb(total)} back into .grad per step",
            evidence,
            "DistributedDataParallel(model, gradient_as_bucket_view=True)",
            {"gradient_as_bucket_view": True},
            math.nan,
            math.nan,
            text,
            "steps",
        )
    ]


# ---- FSDP -----------------------------------------------------------------------------------------
def unit_settings(job) -> dict:
    """{FSDP unit name: its settings, with ``wrapper`` (``fsdp2``, ``fsdp1``)} from the first rank's log
    that noted any (``integrations.fsdp``: ``reshard_after_forward`` as in force after FSDP's lazy init,
    FSDP2's mesh, FSDP1's sharding strategy); {} when none were noted."""
    for notes in sorted(job or (), key=lambda n: n.get("rank", -1)):
        units = {
            str(item.get("module")): dict(item.get("values") or {}, wrapper=item.get("wrapper"))
            for item in notes.get("settings") or ()
            if item.get("wrapper") in FSDP_WRAPPERS
        }
        if units:
            return units
    return {}


# what frees a unit's parameters after its forward, and the change that keeps them (FSDP1: its
# sharding strategy; HYBRID_SHARD's counterpart is torch's _HYBRID_SHARD_ZERO2)
FSDP_WRAPPERS = ("fsdp2", "fsdp1")
FSDP1_KEEPING = {"FULL_SHARD": "SHARD_GRAD_OP", "HYBRID_SHARD": "_HYBRID_SHARD_ZERO2"}


def fsdp_gather_mask(df) -> np.ndarray:
    """The rows that are an FSDP unit's all-gather in the backward (``integrations.fsdp`` names the unit
    and the phase): what ``fsdp_reshard`` reads (the engine stages them apart). FSDP calls
    torch.distributed itself: an all-gather of a functional collective (``funcol.``, ``compiled.``:
    tensor parallel's, in a unit's backward too) or of a coalescing block is not FSDP's."""
    if any(c not in df.columns for c in ("phase", "module", "collective", "op")):
        return np.zeros(len(df), bool)
    module = df["module"]
    return (
        (df["collective"].astype(str) == "all_gather").to_numpy()
        & (df["phase"].astype(str) == "backward").to_numpy()
        & (module.notna() & (module.astype(str) != "")).to_numpy()
        & ~df["op"].astype(str).str.contains(".", regex=False).to_numpy()
    )


def _group_sizes(rows) -> np.ndarray:
    """Per row, how many ranks its group has (``group_ranks``, each distinct value parsed once; NaN
    where not known)."""
    if "group_ranks" not in rows.columns:
        return np.full(len(rows), np.nan)
    import pandas as pd

    codes, uniques = pd.factorize(rows["group_ranks"].astype(str), use_na_sentinel=True)
    sizes = np.array([float(len(expand_ranks(u))) if u and u != "nan" else math.nan for u in uniques] + [math.nan])
    return sizes[codes]


def fsdp_reshard(df, steps_table, st, job=None) -> list:
    """Keep the parameters of the FSDP units that free them after their forward and whose all-gather of
    them again in the backward the training thread waits for: FSDP2 ``reshard_after_forward=False``,
    FSDP1 ``sharding_strategy=SHARD_GRAD_OP`` (from FULL_SHARD; ``_HYBRID_SHARD_ZERO2`` from
    HYBRID_SHARD). Per steady-state step and rank, those all-gathers' exposed time (a call the thread
    was inside throughout, timed ``host``: its arrival-free transfer time; one it waited for: that wait,
    at most its transfer time; neither (an accelerator's calls on FSDP's own stream): unknown, and no
    advice). The gain is that time (the all-gathers go; their copies in and out of FSDP's buffers, not
    in the log, go too); the cost is memory: each unit keeps its gathered parameters from its forward
    to its backward. One item per change (FSDP2's, each FSDP1 strategy's)."""
    changes: dict = {}  # the change -> its units
    for name, values in unit_settings(job).items():
        if values.get("reshard_after_forward"):
            if values["wrapper"] == "fsdp2":
                changes.setdefault(("reshard_after_forward", False), set()).add(name)
            elif values.get("sharding_strategy") in FSDP1_KEEPING:
                changes.setdefault(("sharding_strategy", FSDP1_KEEPING[values["sharding_strategy"]]), set()).add(name)
    if not changes or "timing" not in df.columns or "module" not in df.columns:
        return []
    rows = steady_rows(df, steps_table)
    gathers = rows[fsdp_gather_mask(rows)]
    out = []
    for change, units in changes.items():
        item = _fsdp_keep(gathers[gathers["module"].astype(str).isin(units).to_numpy()], st, change)
        out += [item] if item is not None else []
    return out


def _fsdp_keep(g, st, change):
    """``fsdp_reshard``'s item for one change (setting, value) from its units' backward all-gathers
    ``g``, or None when their exposed time is unknown or too small."""
    if not len(g):
        return None
    transfer = transfer_durations(g)
    blocking = g["timing"].astype(str).isin(BLOCKING_TIMINGS).to_numpy()
    wait = g["wait_us"].to_numpy(np.float64) if "wait_us" in g.columns else np.full(len(g), np.nan)
    exposed = np.where(blocking, transfer, np.minimum(wait, transfer))  # NaN: not known
    if np.isnan(exposed).all():
        return None
    module = g["module"].astype(str).to_numpy()
    # the ranks a unit's parameters are gathered from in the backward: the all-gather's group (its
    # mesh's shard dimension; fewer with reshard_after_forward=<int>, which keeps a shard of that many)
    size = _group_sizes(g)
    t = g[["rank", "step"]].assign(module=module, exposed=exposed)
    t = t.assign(held=g["bytes"].to_numpy(np.float64) * (1 - 1 / size))  # gathered less the rank's own shard
    by_step = t.assign(unknown=np.isnan(exposed)).groupby(["rank", "step"])
    per_step = by_step["exposed"].sum()[~by_step["unknown"].any()]  # a step with one unknown: unknown
    gain = float(per_step.median()) if len(per_step) else math.nan
    step_us = st["step_p50_us"]
    if per_step.index.get_level_values("step").nunique() < MIN_STEPS or not gain >= max(
        MIN_GAIN_SHARE * step_us, MIN_GAIN_US
    ):
        return None
    per_unit = t.groupby(["module", "rank", "step"]).agg(exposed=("exposed", "sum"), held=("held", "max"))
    per_unit = per_unit.groupby(level="module").median().sort_values("exposed", ascending=False)
    names = [str(m) for m in per_unit.index]
    held = float(per_unit["held"].sum())
    shown = ", ".join(repr(m) for m in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    evidence = dict(
        steps=int(per_step.index.get_level_values("step").nunique()),
        step_us=step_us,
        units=len(names),
        backward_all_gather_us=gain,
        backward_all_gathers=int(round(float(t.groupby(["rank", "step"]).size().median()))),
        held_bytes=held,
    )
    setting, value = change
    how = f"{setting}={value}"
    if setting == "reshard_after_forward":
        code = f"fully_shard(module, {how}) for the units {shown}"
    else:  # FSDP1: the strategy is given where the units are wrapped (once, at the root, with auto-wrapping)
        code = f"FullyShardedDataParallel(..., sharding_strategy=ShardingStrategy.{value}) for the units {shown}"
    memory = f"{_mb(held)} more memory per rank" if held >= 0 else "more memory per rank (not known how much)"
    text = (
        f"{len(names)} FSDP unit(s) free their parameters after the forward and gather them again in the "
        f"backward: those all-gathers hold the training thread {_ms(gain)} per step ({_pct(gain / step_us)} of "
        f"the step; their transfer time, waits for other ranks left out). With {how} a unit keeps its gathered "
        f"parameters from its forward to its backward: no all-gather there, for {memory} (its parameters' "
        f"bytes less its own shard, kept; the units by their time, the largest first: {shown}). FSDP's copies "
        "into and out of its all-gather buffers go with them; the log does not time those: the gain counts "
        "the all-gathers only."
    )
    return Advice(
        "fsdp_reshard",
        f"FSDP: {how} on {len(names)} unit(s) saves their backward all-gathers, {_ms(gain)} per step"
        + (f", for {_mb(held)} of memory" if held >= 0 else ""),
        evidence,
        code,
        {setting: value, "units": names},
        gain,
        gain / step_us if step_us > 0 else math.nan,
        text,
        "steps",
    )


# ---- small messages ------------------------------------------------------------------------------
def latency_fit(times, nbytes):
    """(latency_us, us_per_byte) of ``time = latency + bytes x us_per_byte`` fitted to the median time
    of each message size (power of two) with enough calls; None when the sizes are too few or too
    close, or the fit is not a positive latency and bandwidth."""
    import pandas as pd

    t = pd.DataFrame({"t": times, "s": size_bucket(nbytes), "b": np.asarray(nbytes, np.float64)})
    t = t[np.isfinite(t["t"]) & (t["b"] > 0)]
    per = t.groupby("s").agg(t=("t", "median"), b=("b", "median"), n=("t", "size"))
    per = per[per["n"] >= MIN_CALLS_PER_SIZE]
    if len(per) < MIN_SIZES or per["b"].max() < MIN_SIZE_SPAN * per["b"].min():
        return None
    slope, intercept = np.polyfit(per["b"].to_numpy(), per["t"].to_numpy(), 1)
    if not (slope > 0 and intercept > 0):
        return None
    return float(intercept), float(slope)


def _back_to_back_us(rows) -> np.ndarray:
    """Per row: the time from its end to the start of the rank's next call when that call is the next
    one of the same selection in the same step (consecutive seq): the loop's own time between the calls
    (0 otherwise)."""
    rank, seq, step = rows["rank"].to_numpy(), rows["seq"].to_numpy(np.int64), rows["step"].to_numpy()
    start = rows["start_ns"].to_numpy(np.int64)
    end = start + (np.nan_to_num(rows["duration_us"].to_numpy(np.float64)) * 1e3).astype(np.int64)
    order = lexsort((seq, rank))
    gap = np.zeros(len(rows))
    if len(rows) > 1:
        o = order
        nxt = (rank[o][1:] == rank[o][:-1]) & (seq[o][1:] == seq[o][:-1] + 1) & (step[o][1:] == step[o][:-1])
        g = np.where(nxt, np.clip(start[o][1:] - end[o][:-1], 0, None) / 1e3, 0.0)
        gap[o[:-1]] = g
    return gap


def small_messages(df, steps_table, st, conf=None) -> list:
    """Coalesce the latency-bound calls of a group when they are many per step. The latency model is
    fitted to every steady-state collective of the run (all groups, all sizes: ``latency_fit``); with
    one size only, calls of at most ``SMALL_BYTES`` are taken as latency-bound. The expected gain: the
    calls' time per step on the training thread (their durations, waits included, and the time between
    back-to-back calls) minus one call of all their bytes at the fitted latency and bandwidth."""
    import pandas as pd

    rows = steady_rows(df, steps_table)
    rows = rows[rows["bytes"].to_numpy() > 0].reset_index(drop=True)
    if not len(rows):
        return []
    times = transfer_durations(rows)  # by position: rows' index is 0..n-1
    fit = latency_fit(times, rows["bytes"])
    cand = rows[~_bucket_mask(rows)]
    bound = fit[0] / fit[1] if fit is not None else float(SMALL_BYTES)
    small_all = cand[cand["bytes"].to_numpy() <= bound]
    if not len(small_all):
        return []
    step_us = st["step_p50_us"]
    steps = rows["step"].nunique()
    out = []
    keys = small_all[["group", "collective"]].astype(str)
    # only the keys with enough calls per step and steps go on (vectorised: a log with as many names as
    # calls costs no more than one with a handful)
    per_key = small_all.groupby([keys["group"], keys["collective"], small_all["rank"], small_all["step"]]).size()
    calls_of = per_key.groupby(level=[0, 1, 2]).median().groupby(level=[0, 1]).median()
    steps_of = per_key.reset_index().groupby(["group", "collective"])["step"].nunique()
    wanted = calls_of.index[(calls_of >= MIN_SMALL_CALLS) & (steps_of.reindex(calls_of.index) >= min(MIN_STEPS, steps))]
    if not len(wanted):
        return []
    keep = pd.MultiIndex.from_frame(keys).isin(wanted)
    small_all, keys = small_all[keep], keys[keep]
    for (group, collective), small in small_all.groupby([keys["group"], keys["collective"]], sort=True):
        per_step = small.groupby(["rank", "step"]).size()
        calls = float(per_step.groupby(level="rank").median().median()) if len(per_step) else 0.0
        if calls < MIN_SMALL_CALLS or small["step"].nunique() < min(MIN_STEPS, steps):
            continue
        own = np.nan_to_num(small["duration_us"].to_numpy(np.float64))
        spent = own + _back_to_back_us(small)
        cost_us = float(np.median(small.assign(c=spent).groupby(["rank", "step"])["c"].sum()))
        step_bytes = float(small.groupby(["rank", "step"])["bytes"].sum().median())
        one_us = float(np.nanmedian(times[small.index]))
        if fit is not None:
            latency_us, us_per_byte = fit
            predicted_us = latency_us + step_bytes * us_per_byte
        else:  # one size: the bandwidth is not in the log; a call up to SMALL_BYTES costs what one of them does
            latency_us, us_per_byte = one_us, math.nan
            predicted_us = one_us * max(1.0, step_bytes / SMALL_BYTES)
        gain = cost_us - predicted_us
        if gain < max(MIN_GAIN_SHARE * step_us, MIN_GAIN_US):
            continue
        ops = sorted(set(small["op"].astype(str)))
        evidence = dict(
            steps=int(small["step"].nunique()),
            step_us=step_us,
            calls_per_step=calls,
            latency_us=latency_us,
            us_per_mib=us_per_byte * MIB,
            latency_bound_bytes=bound,
            small_bytes_median=float(small["bytes"].median()),
            small_bytes_per_step=step_bytes,
            small_us_per_step=cost_us,
            transfer_us_median=one_us,
            predicted_us=predicted_us,
            one_size=1.0 if fit is None else 0.0,  # 1: no latency fit (one message size)
        )
        model = (
            f"a call's fixed latency ({_ms(latency_us)}) and {_ms(us_per_byte * MIB)} per MiB, fitted to every "
            f"steady-state call of the run, put the latency-bound size at {_bytes(bound)}"
            if fit is not None
            else f"the run has one message size only: calls up to {_bytes(SMALL_BYTES)} are taken as latency-bound, "
            f"one call of them costing what one takes now ({_ms(one_us)})"
        )
        text = (
            f"{_n(calls)} {collective} calls per step on group {group} ({', '.join(ops)}) move "
            f"{_bytes(step_bytes)} in messages of about {_bytes(evidence['small_bytes_median'])}; they hold the "
            f"training thread {_ms(cost_us)} per step (their durations, waits included, and the time between "
            f"back-to-back calls). {model[0].upper() + model[1:]}. One call for all of them would take about "
            f"{_ms(predicted_us)}: about {_ms(gain)} less per step."
        )
        change = (
            f"issue the {_n(calls)} {collective} calls of group {group} inside one "
            f"`with torch.distributed._coalescing_manager(group=...):` block, or flatten them into one tensor "
            f"(torch._utils._flatten_dense_tensors) and make one call"
        )
        out.append(
            Advice(
                "small_messages",
                f"coalesce {_n(calls)} small {collective} calls per step on group {group}",
                evidence,
                change,
                {},
                gain,
                gain / step_us,
                text,
                "summary",
            )
        )
    return out


# ---- stragglers ----------------------------------------------------------------------------------
# the cause of a straggler's lateness is the figure (CPU time, input time, wall time outside
# communication) by which it exceeds the other ranks' by at least this share of its lateness
CAUSE_SHARE = 0.5
CAUSES = ("input", "work", "host", "unknown")


def step_marks(job):
    """Per (rank, step) from the logs' step marks (``df.attrs["job_notes"]``: the training thread's wall
    clock and CPU time where each step starts and at its first root forward, ``integrations.steps``):
    wall_us (from the step's start to the next step's), cpu_us (the training thread's CPU time in it),
    input_us and input_cpu_us (from the step's start to its first root forward: loading its input;
    NaN where no forward was noted)."""
    import pandas as pd

    cols = ["rank", "step", "wall_us", "cpu_us", "input_us", "input_cpu_us"]
    parts: list = []  # per rank: its columns (numpy per rank: a DataFrame per rank took 24 s at 16,384 ranks)
    for notes in job or ():
        marks = np.asarray(notes.get("step_marks") or [], dtype=np.float64).reshape(-1, 4)
        if not len(marks):
            continue
        step, at, ns, cpu = marks[:, 0].astype(np.int64), marks[:, 1], marks[:, 2], marks[:, 3]
        begun = np.flatnonzero(at == 0)
        # per step, its last start mark (steps in order) and its first forward mark
        last = np.unique(step[begun][::-1], return_index=True)[1]
        keep = begun[len(begun) - 1 - last]
        starts, fwd = step[keep], np.flatnonzero(at == 1)
        fwd_steps, fwd_first = np.unique(step[fwd], return_index=True)
        parts.append(
            {
                "rank": np.full(len(keep), int(notes.get("rank", -1)), np.int64),
                "step": starts,
                "wall_us": (_at_step(starts + 1, starts, ns[keep]) - ns[keep]) / 1e3,
                "cpu_us": (_at_step(starts + 1, starts, cpu[keep]) - cpu[keep]) / 1e3,
                "input_us": (_at_step(starts, fwd_steps, ns[fwd][fwd_first]) - ns[keep]) / 1e3,
                "input_cpu_us": (_at_step(starts, fwd_steps, cpu[fwd][fwd_first]) - cpu[keep]) / 1e3,
            }
        )
    if not parts:
        return pd.DataFrame(columns=cols)
    return pd.DataFrame({c: np.concatenate([p[c] for p in parts]) for c in cols})


def _at_step(wanted, steps, values):
    """``values[i]`` where ``steps[i]`` is each of ``wanted`` (``steps`` sorted and unique), else NaN."""
    if not len(steps):
        return np.full(len(wanted), np.nan)
    pos = np.minimum(np.searchsorted(steps, wanted), len(steps) - 1)
    return np.where(steps[pos] == wanted, values[pos], np.nan)


RANK_STEP_COLUMNS = ("steps", "step_us", "busy_us", "exposed_us", "outside_us", "cpu_us", "input_us", "input_cpu_us")


RANK_STEPS_READS = ("rank", "step", "stage", "step_us", "busy_us", "exposed_us")  # of steps.per_step(by_rank=True)


def rank_steps(by_rank, marks=None):
    """The report's per-rank table of the steady state (section ``rank_steps``), medians over the
    steady-state steps of each rank: step_us, busy_us (communication in flight, every call: the async
    ones too), exposed_us, outside_us (step_us - busy_us: the step outside communication), and from the
    step marks cpu_us (the training thread's CPU time), input_us / input_cpu_us (from the step's start
    to its first root forward). The straggler advice quotes these figures and no others."""
    import pandas as pd

    steady = by_rank[by_rank["stage"] == "steady"]
    t = steady[[c for c in RANK_STEPS_READS if c != "stage"]].assign(outside_us=steady["step_us"] - steady["busy_us"])
    if marks is not None and len(marks):
        t = t.merge(marks[["rank", "step", "cpu_us", "input_us", "input_cpu_us"]], on=["rank", "step"], how="left")
    else:
        t = t.assign(cpu_us=np.nan, input_us=np.nan, input_cpu_us=np.nan)
    if not len(t):
        return pd.DataFrame(columns=["rank", *RANK_STEP_COLUMNS])
    g = t.groupby("rank", sort=True)
    columns = list(RANK_STEP_COLUMNS[1:])
    known = [c for c in columns if t[c].notna().any()]  # no marks: three columns of NaN, not medians
    out = g[known].median().reindex(columns=columns)
    out.insert(0, "steps", g.size())
    return out.reset_index()


def _cause(own: dict, others: dict, late_us: float) -> str:
    """Which of the rank's figures exceeds the others' by CAUSE_SHARE of its lateness: its input
    (``input``), its CPU time (``work``), else its wall time outside communication without its CPU
    time (``host``); ``unknown`` when none does or the marks are missing."""
    need = CAUSE_SHARE * late_us

    def extra(col):
        return own[col] - others[col]

    if extra("input_us") >= need:  # NaN (no forward noted) compares False
        return "input"
    if extra("cpu_us") >= need:
        return "work"
    if extra("outside_us") >= need and extra("cpu_us") < need:
        return "host"
    return "unknown"


def straggler(df, steps_table, st, cross, by_rank=None, job=None, verdict_=None) -> list:
    """A rank late in most steps by a steady amount (``stragglers.verdict``), with its cause told from
    the figures of the report's ``rank_steps`` table (``by_rank``: ``per_step(df, by_rank=True)`` when
    already computed; ``job``: the logs' job notes, ``df.attrs["job_notes"]``)."""
    v = verdict_ if verdict_ is not None else stragglers.of(cross, steps_table)
    if v is None or not v["straggler"]:
        return []
    by_rank = per_step(df, by_rank=True) if by_rank is None else by_rank
    table = rank_steps(by_rank, step_marks(job))
    return straggler_advice(v, table, st["step_p50_us"])


def straggler_advice(v: dict, table, step_us: float) -> list:
    """The straggler item from the verdict (its keys: rank, steps, last_steps, late_median_us, p_value,
    share_of_step) and the ``rank_steps`` table: every figure quoted is a cell of that table (the
    others': the median of their rows)."""
    r = int(v["rank"])
    own_rows = table[table["rank"] == r]
    others_rows = table[table["rank"] != r]
    if not len(own_rows) or not len(others_rows):
        return []
    cols = list(RANK_STEP_COLUMNS[1:])
    own = {c: float(own_rows[c].iloc[0]) for c in cols}
    others = {c: float(np.nanmedian(others_rows[c])) if others_rows[c].notna().any() else math.nan for c in cols}
    late = float(v["late_median_us"])
    cause = _cause(own, others, late)
    ev = dict(
        rank=r,
        steps=int(v["steps"]),
        last_steps=int(v["last_steps"]),
        late_us=late,
        late_share=float(v["share_of_step"]),
        p_value=float(v["p_value"]),
        step_us=step_us,
        cause=CAUSES.index(cause),
    )
    for name, medians in (("rank", own), ("others", others)):
        for c in cols:
            ev[f"{name}_{c}"] = medians[c]

    def pair(col):
        return f"{_ms(own[col])} against {_ms(others[col])}"

    stage = v.get("measure") == "work"  # a pipeline's stage (stragglers._pipeline)
    there = stragglers.place(v)  # where, for the measure at one collective's place in the step
    head = (
        f"rank {r} worked a median {_ms(late)} per step longer than any other pipeline stage (its step less its "
        f"receives' waits for their sends), the longest of all ranks in {v['last_steps']} of {v['steps']} "
        f"steady-state steps (p = {v['p_value']:.2g}): the pipeline runs at its pace. "
        if stage
        else f"rank {r} held the other ranks up a median {_ms(late)} per step{there}, the longest of "
        f"all ranks {'there ' if there else ''}in {v['last_steps']} of {v['steps']} steady-state steps "
        f"(p = {v['p_value']:.2g}): the others wait for it. "
    )
    figures = (
        f"Per step (medians; table: Ranks' steps), its step outside communication {pair('outside_us')} on the "
        f"others, communication in flight {pair('busy_us')}"
    )
    if not math.isnan(own["cpu_us"]):
        figures += f", its training thread's CPU time {pair('cpu_us')}"
    if not math.isnan(own["input_us"]):
        figures += (
            f", from its step's start to its forward (loading its input) {pair('input_us')}, of which CPU time "
            f"{pair('input_cpu_us')}"
        )
    need = f"(at least half its lateness, {_ms(CAUSE_SHARE * late)}, more than the others')"
    if cause == "input":
        why = (
            f"{figures}: the time before its forward {need} says it waits on its input (a data loader too slow "
            "for this rank, uneven samples or preprocessing)."
        )
        title = "waiting on its input"
        change = (
            f"make rank {r}'s input ready in time: more DataLoader workers (num_workers, prefetch_factor), "
            "pin_memory, or even out its samples / preprocessing"
        )
    elif cause == "work":
        why = (
            f"{figures}: its CPU time {need} says it does more work (a larger batch or sequence, uneven data "
            "shards, extra work in its own code)."
        )
        title = "more work on that rank"
        change = (
            f"even out the pipeline's stages: move layers off rank {r}'s stage (or give it the lighter ones)"
            if stage
            else f"even out the work of rank {r}: its batch / sequence lengths, its data shard, code only it runs"
        )
    elif cause == "host":
        why = (
            f"{figures}: its wall time outside communication {need} without its CPU time says the thread was kept "
            "off the CPU (another process on its cores, too few cores for its threads) or waited on something "
            "outside its own work and its input."
        )
        title = "kept off the CPU by its host"
        change = (
            f"look at what else runs on rank {r}'s host (top / nvidia-smi: other jobs, data loader workers, "
            "OMP threads over the cores) and give it its cores"
        )
    else:
        known = not math.isnan(own["cpu_us"])
        why = f"{figures}" + (
            ": no figure accounts for half of its lateness, the cause is not in the log."
            if known
            else "; this log has no per-step CPU time (a log of an older commpatch, CSV): the cause "
            "(its work, its host or its input) cannot be told."
        )
        title = "cause unknown"
        change = (
            f"find what rank {r}'s stage does more than the others (heavier layers: move some to the other stages; "
            "slower input; another process on its CPU / GPU) and even it out"
            if stage
            else f"find what rank {r} does more than the others before its collectives (uneven data, slower input, "
            "another process on its CPU / GPU) and even it out"
        )
    return [
        Advice(
            "straggler",
            f"rank {r} is a straggler: {_ms(late)} late per step, {title}",
            ev,
            change,
            {},
            late,
            late / step_us if step_us > 0 else math.nan,
            head + why,
            "rank_steps",
        )
    ]


# ---- wording -------------------------------------------------------------------------------------
def _nice_mb(mb: float) -> float:
    """``mb`` rounded down to two significant digits (1.6, 12, 250)."""
    if mb <= 0:
        return mb
    scale = 10 ** (math.floor(math.log10(mb)) - 1)
    return math.floor(mb / scale) * scale if scale >= 1 else round(math.floor(mb / scale) * scale, 6)


def _ms(us) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    return f"{us / 1e3:.3g} ms" if abs(us) >= 100 else f"{us:.3g} us"


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def _mb(nbytes) -> str:
    return f"{nbytes / MIB:.3g} MiB" if nbytes >= 0.1 * MIB else _bytes(nbytes)


def _bytes(nbytes) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", 1024.0)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def _n(x) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


__all__ = [
    "Advice",
    "KEYS",
    "ROW_RULES",
    "advice",
    "bucket_steps",
    "ddp_bucket_size",
    "ddp_grad_copy",
    "fsdp_gather_mask",
    "fsdp_reshard",
    "latency_fit",
    "small_messages",
    "straggler",
]
