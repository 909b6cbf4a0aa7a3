"""GPU validation kit: does commpatch measure what the GPU did? Run it on a CUDA machine, send the JSON.

    python benchmarks/gpu/validate.py [--quick] [--json results.json]           # 1 GPU
    torchrun --nproc-per-node N benchmarks/gpu/validate.py --json results.json  # N GPUs, NCCL

Checks (rank 0 prints one pass / fail / skip row each, with what was measured and the bound):
  1. duration vs kernel: commpatch's ``duration_us`` of all_reduce, all_gather_into_tensor,
     reduce_scatter_tensor and broadcast (sizes x sync / async) against the NCCL kernel times that
     torch.profiler (CUPTI) saw for the same calls, paired in issue order; each with the stream
     idle (the duration then includes the launch latency: bounded by the call's own host time)
     and with the stream busy before the call (the events then bracket the kernel: a tight bound);
  2. own time: a small async collective issued right after a large one: ``own_us`` close to its
     kernel, ``duration_us`` including the wait behind the large one;
  3. step time of a small DDP model with / without commpatch, alternating rounds (<= 1.02);
  4. no host synchronization on the hot path: CUDA runtime synchronize calls in the profiler's
     CPU-side trace, and Python-level synchronize calls, with and without commpatch (equal);
  5. ``TORCH_NCCL_ENABLE_TIMING=1``: async rows say ``timing=nccl``, durations vs kernels;
  6. on one rank, what needs several GPUs is a row that says it was not run.
benchmarks/gpu/extras.py checks what real jobs do on a GPU (CUDA graphs, compile, a bf16 DDP step,
FSDP2 / DTensor, gloo with CUDA tensors, 100,000 calls); benchmarks/gpu/device_run.sh runs both.
Exit status 0 when every check that ran passed, 1 otherwise. Without CUDA (or NCCL) every GPU
check is a skip, a gloo smoke run exercises the plumbing, and the last line says nothing was
validated (exit 0). docs/gpu-validation.md explains each check and its tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings

# The default group must not time its collectives with NCCL's own events (check 1 validates the
# device-event path); check 5 turns NCCL timing on for a group of its own. Read before torch is.
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
USER_NCCL_TIMING = os.environ.pop(NCCL_TIMING_ENV, None)

# torch >= 2.13 calls all_gather_into_tensor / reduce_scatter_tensor deprecated (for *_single): the
# kit measures them on purpose, as the issue lists them and as most code still calls them.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import commpatch  # the installed one (its path goes into the JSON)
except ImportError:  # not installed: this checkout's
    sys.path.insert(0, REPO)
    import commpatch

KIT_VERSION = 1
KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
KERNEL_WORD = {
    "all_reduce": "AllReduce",
    "all_gather_into_tensor": "AllGather",
    "reduce_scatter_tensor": "ReduceScatter",
    "broadcast": "Broadcast",
}
CHECKS = {
    "duration_vs_kernel": "duration vs kernel",
    "own_vs_duration": "own time vs queue",
    "step_time": "step time",
    "no_host_sync": "no host sync",
    "nccl_timing": "nccl timing",
    "multi_gpu": "NCCL across GPUs",
}
# Tolerances, as (relative, absolute us) for the median and for p95 of (commpatch - kernel):
# the bound is the larger of the two. "queued": the stream is busy when the call is issued, so the
# kernel is launched before the start event fires; what is left is two cross-stream event waits
# (current stream -> NCCL's stream and back, a few us each) and the event resolution (0.5 us).
# "nccl": NCCL's own events, queued likewise.
# "idle": the start event fires when it is recorded, at the call's start on the host; the end event
# is recorded before the call returns (sync: after it; async: in the future's then() callback,
# which runs inside the call) and fires at the later of that and the kernel's end. So on an idle
# stream the excess over the kernel is at most the call's own host time (measured around the call
# by the kit, commpatch's wrapper included): the bound is on (excess - that host time), per call. A
# first GPU run (H100, torch 2.11) showed what a fixed bound missed: c10d's issue path takes 57-64 us
# for a call with no device work and the async then() ~40 us more, so a fixed +100 us flagged the
# correct async rows and would pass a wrong one on a faster host.
TOL = {
    "idle": {"med": (0.0, 10.0), "p95": (0.0, 25.0)},  # on (commpatch - kernel - host time of the call)
    "queued": {"med": (0.05, 15.0), "p95": (0.15, 40.0)},
    "nccl": {"med": (0.05, 10.0), "p95": (0.15, 30.0)},  # NCCL's events sit around the kernel
    "own": {"med": (0.25, 30.0), "p95": (0.50, 60.0)},  # own time: plus the gap between kernels
}
UNDER = (0.03, 2.0)  # never shorter than the kernel by more than 3% or 2 us (events bracket it)
QUEUE_FRACTION = 0.9  # a call queued behind a large one: duration >= 90% of the large kernel
SELF_CHECK_US = 20.0  # 1 rank, a collective NCCL runs nothing for, issued behind a 1 ms sleep
STEP_RATIO_MAX = 1.02
SLEEP_US = 1000.0  # stream busy time before each "queued" call (> the host's issue time)
WARMUP = 3
IN_PLACE = ("all_reduce", "broadcast")  # on 1 rank NCCL runs nothing for these (ncclLaunchOneRank: no-op)
LOG_WAIT_US = 50_000  # check 5: an async call behind this much queued work, then log() at once
SYNC_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",  # runtime API
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
)  # driver API
LOOP_LABEL = "commpatch_kit::hot_loop"
KERNEL_NAME = re.compile(r"^(void )?nccl(Dev)?Kernel")  # ncclDevKernel_AllReduce_Sum_f32_RING_LL(...), ncclKernel_...
MEMCPY_NAME = re.compile(r"^Memcpy DtoD")  # a 1-rank NCCL collective out of place is a copy


# ------------------------------------------------------------------ pure helpers (tested on CPU)
def parse_sizes(text: str) -> list[int]:
    """'8K,256K,8M,128M' -> bytes (K, M, G are powers of 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().upper().rstrip("B")
        m = re.fullmatch(r"(\d+)([KMG]?)", part)
        if not m or int(m.group(1)) == 0:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} is not a size like 8K, 256K, 8M or 1G")
        out.append(int(m.group(1)) * 1024 ** " KMG".index(m.group(2) or " "))
    return out


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def pct(values, q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def compare(measured_us, kernel_us, tol: dict, host_us=None) -> dict:
    """commpatch's times against kernel times, pair by pair (same order): median and p95 of the ratio
    and of the excess, and the verdict against ``tol`` (a TOL entry). ``host_us``: each call's host
    time, allowed on top of the bound (an idle stream: see TOL)."""
    if len(measured_us) != len(kernel_us) or not measured_us:
        raise ValueError(f"{len(measured_us)} commpatch rows against {len(kernel_us)} kernels")
    if host_us is not None and len(host_us) != len(measured_us):
        raise ValueError(f"{len(host_us)} host times against {len(measured_us)} rows")
    excess = [m - k for m, k in zip(measured_us, kernel_us)]
    beyond = excess if host_us is None else [e - h for e, h in zip(excess, host_us)]
    ratio = [m / k if k > 0 else math.inf for m, k in zip(measured_us, kernel_us)]
    kmed = statistics.median(kernel_us)
    lim_med = max(tol["med"][0] * kmed, tol["med"][1])
    lim_p95 = max(tol["p95"][0] * kmed, tol["p95"][1])
    under = max(UNDER[0] * kmed, UNDER[1])
    e_med, e_p95 = statistics.median(excess), pct(excess, 95)
    b_med, b_p95 = statistics.median(beyond), pct(beyond, 95)
    nan = any(math.isnan(m) for m in measured_us)
    out = {
        "n": len(excess),
        "kernel_med_us": kmed,
        "commpatch_med_us": statistics.median(measured_us),
        "ratio_med": statistics.median(ratio),
        "ratio_p95": pct(ratio, 95),
        "excess_med_us": e_med,
        "excess_p95_us": e_p95,
        "limit_med_us": lim_med,
        "limit_p95_us": lim_p95,
        "limit_under_us": under,
        "ok": not nan and -under <= e_med and b_med <= lim_med and b_p95 <= lim_p95,
    }
    if host_us is not None:
        out.update(host_med_us=statistics.median(host_us), beyond_host_med_us=b_med, beyond_host_p95_us=b_p95)
    return out


def describe(c: dict) -> str:
    host = ""
    if "host_med_us" in c:
        host = f"; call's host time {c['host_med_us']:.1f} us, beyond it {c['beyond_host_med_us']:+.1f} us"
    return (
        f"x{c['ratio_med']:.3f} p95 x{c['ratio_p95']:.3f} ({c['commpatch_med_us']:.1f} vs kernel "
        f"{c['kernel_med_us']:.1f} us, {c['excess_med_us']:+.1f} us{host}, n={c['n']})"
    )


def bound(tol: dict) -> str:
    (rm, am), (rp, ap) = tol["med"], tol["p95"]
    if tol is TOL["idle"]:
        return f"+<=the call's host time +{am:g}us med, +{ap:g}us p95"
    return f"+<=max({rm:.0%},{am:g}us) med, max({rp:.0%},{ap:g}us) p95"


def clean(value):
    """JSON has no NaN or infinity: null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def row(check: str, name: str, status: str, measured: str, threshold: str, **data) -> dict:
    return {"check": check, "name": name, "status": status, "measured": measured, "threshold": threshold, "data": data}


def failed_row(check: str, name: str, exc: BaseException) -> dict:
    """A check that raised: a failure of the check (or of the kit: the JSON has the traceback)."""
    import traceback

    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return row(
        check,
        name,
        "fail",
        f"raised {type(exc).__name__}: {first}",
        "runs without error",
        raised=True,
        traceback=traceback.format_exc()[-4000:],
    )


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per check name across ranks: fail if any rank failed, skip if every rank skipped;
    the numbers shown are rank 0's, or the first failing rank's (named)."""
    order, by_name = [], {}
    for rank, rows in enumerate(per_rank):
        for r in rows:
            if r["name"] not in by_name:
                order.append(r["name"])
                by_name[r["name"]] = []
            by_name[r["name"]].append(dict(r, rank=rank))
    merged = []
    for name in order:
        rows = by_name[name]
        bad = [r for r in rows if r["status"] == "fail"]
        shown = bad[0] if bad else rows[0]
        status = (
            "fail"
            if bad or len(rows) != len(per_rank)
            else ("skip" if all(r["status"] == "skip" for r in rows) else "pass")
        )
        measured = shown["measured"] if len(per_rank) == 1 else f"rank {shown['rank']}: {shown['measured']}"
        if len(rows) != len(per_rank):
            measured += f" (only {len(rows)} of {len(per_rank)} ranks reported it)"
        merged.append(dict(shown, status=status, measured=measured, ranks=rows))
    return merged


def render_table(rows: list[dict]) -> str:
    w = max([len("check")] + [len(r["name"]) for r in rows])
    lines = [f"{'status':<6}  {'check':<{w}}  measured  [threshold]", f"{'-' * 6}  {'-' * w}  {'-' * 30}"]
    for r in rows:
        lines.append(f"{r['status'].upper():<6}  {r['name']:<{w}}  {r['measured']}  [{r['threshold']}]")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> tuple[int, str]:
    """(exit status, the closing line)."""
    ran = [r for r in rows if r["status"] != "skip"]
    failed = [r for r in ran if r["status"] == "fail"]
    if not ran:
        return 0, "NOTHING VALIDATED: every GPU check was skipped (see the reasons above); run this on a CUDA machine."
    if failed:
        return 1, f"FAILED: {len(failed)} of {len(ran)} checks ({len(rows) - len(ran)} skipped). Please send the JSON."
    return 0, f"PASSED: all {len(ran)} checks ({len(rows) - len(ran)} skipped)."


# ------------------------------------------------------------------ environment
def environment(torch, world: int) -> dict:
    env = {
        "kit_version": KIT_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "world_size": world,
        "cuda_available": torch.cuda.is_available(),
        "user_TORCH_NCCL_ENABLE_TIMING": USER_NCCL_TIMING,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": platform.node(),
    }
    env["commpatch"] = getattr(commpatch, "__version__", "?")
    env["commpatch_path"] = os.path.dirname(commpatch.__file__)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    with contextlib.suppress(Exception):
        env["loadavg"] = os.getloadavg()
    return env


def skip_all(reason: str) -> list[dict]:
    return [row(check, title, "skip", reason, "-") for check, title in CHECKS.items()]


# ------------------------------------------------------------------ the GPU side
class HostEvent:
    """--dry-run-cpu's stand-in for torch.cuda.Event (host clock)."""

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class Gpu:
    """The process's device, group and commpatch output, and what the checks share. ``dry``: the
    same code on CPU tensors and gloo (--dry-run-cpu: proves the kit runs, validates nothing)."""

    def __init__(self, args, torch, dist, commpatch, outdir: str) -> None:
        self.args, self.torch, self.dist, self.commpatch = args, torch, dist, commpatch
        self.dry = args.dry_run_cpu
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cpu") if self.dry else torch.device("cuda", torch.cuda.current_device())
        self.outdir = outdir
        self.output = os.path.join(outdir, "rank{rank}.csv")
        self.sleep_cycles = 0 if self.dry else self._calibrate_sleep()

    def sync(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize()

    def event(self):
        return HostEvent() if self.dry else self.torch.cuda.Event(enable_timing=True)

    def _calibrate_sleep(self) -> int:
        """torch.cuda._sleep cycles for SLEEP_US on this GPU (it spins on the SM clock: measure it)."""
        torch = self.torch
        cycles = 1_000_000
        start, end = self.event(), self.event()
        torch.cuda._sleep(cycles)  # first launch
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3
        return max(1000, int(cycles * SLEEP_US / us))

    # ---- issuing collectives
    def issuer(self, kind: str, nbytes: int, group=None):
        """A function(async_op) issuing ``kind`` with message size ``nbytes`` (S as nccl-tests counts
        it) on float32 tensors made once."""
        torch, dist = self.torch, self.dist
        n = group.size() if group is not None else self.world
        numel = max(n, nbytes // 4 // n * n)
        dev = self.device
        if kind == "all_reduce":
            t = torch.zeros(numel, device=dev)
            return lambda a: dist.all_reduce(t, group=group, async_op=a)
        if kind == "broadcast":
            t = torch.zeros(numel, device=dev)
            src = dist.get_global_rank(group, 0) if group is not None else 0
            return lambda a: dist.broadcast(t, src=src, group=group, async_op=a)
        if kind == "all_gather_into_tensor":
            inp, out = torch.zeros(numel // n, device=dev), torch.empty(numel, device=dev)
            return lambda a: dist.all_gather_into_tensor(out, inp, group=group, async_op=a)
        if kind == "reduce_scatter_tensor":
            inp, out = torch.zeros(numel, device=dev), torch.empty(numel // n, device=dev)
            return lambda a: dist.reduce_scatter_tensor(out, inp, group=group, async_op=a)
        raise ValueError(kind)

    def busy(self, us: float = SLEEP_US) -> None:
        """Keep the current stream busy for ``us`` microseconds (the host returns at once)."""
        if not self.dry:
            self.torch.cuda._sleep(int(self.sleep_cycles * us / SLEEP_US))

    def call(self, issue, async_op: bool, queued: bool) -> float:
        """One call; returns its host time in us (the issue, commpatch's wrapper included)."""
        if queued:
            self.busy()
        t0 = time.perf_counter()
        work = issue(async_op)
        host_us = (time.perf_counter() - t0) * 1e6
        if async_op:
            work.wait()  # the current stream waits for the collective; the host does not
        return host_us

    def profile(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU] + ([] if self.dry else [ProfilerActivity.CUDA]))

    def activities(self, prof) -> list[tuple[float, float, str]]:
        """(start us, end us, name) of the device work NCCL launched, by start time: its kernels, and
        on one rank (where NCCL copies instead of running a kernel) device-to-device copies."""
        from torch.autograd import DeviceType

        out = []
        for e in prof.events():
            if self.dry and e.name.startswith("gloo:"):  # gloo's annotation of each call (host side)
                out.append((e.time_range.start, e.time_range.end, e.name))
            if e.device_type != DeviceType.CUDA or getattr(e, "activity_type", None) == "gpu_user_annotation":
                continue
            if KERNEL_NAME.match(e.name) or (self.world == 1 and MEMCPY_NAME.match(e.name)):
                out.append((e.time_range.start, e.time_range.end, e.name))
        return sorted(out)

    def rows_of(self, kind: str):
        df = self.commpatch.log()
        return df[df["op"] == kind].sort_values("seq")

    def block(self, kind: str, issue, async_op: bool, queued: bool, iters: int):
        """Warm up, then ``iters`` calls under the profiler: (commpatch rows, device activities)."""
        for _ in range(WARMUP):
            self.call(issue, async_op, queued)
        self.sync()
        self.commpatch.reset()
        with self.profile() as prof:
            self.host_us = [self.call(issue, async_op, queued) for _ in range(iters)]
            self.sync()
        return self.rows_of(kind), self.activities(prof)

    # ---- check 1
    def durations_vs_kernels(self) -> list[dict]:
        out = []
        for kind in KINDS:
            for nbytes in self.args.sizes:
                issue = self.issuer(kind, nbytes)
                for async_op in (False, True):
                    name = f"{CHECKS['duration_vs_kernel']}: {kind} {human(nbytes)} {'async' if async_op else 'sync'}"
                    try:
                        out.append(self._duration_row(name, kind, issue, async_op))
                    except Exception as exc:  # noqa: BLE001 - a check that raises is a failure, reported
                        out.append(failed_row("duration_vs_kernel", name, exc))
        return out

    def _duration_row(self, name, kind, issue, async_op) -> dict:
        parts, data, ok, notes = [], {}, True, []
        for mode in ("idle", "queued"):
            rows, acts = self.block(kind, issue, async_op, mode == "queued", self.args.iters)
            labels = set(
                zip(
                    rows["device"].astype(str),
                    rows["backend"].astype(str),
                    rows["timing"].astype(str),
                    rows["async_op"].astype(bool),
                )
            )
            if labels != {("cuda", "nccl", "device_event", async_op)} and not self.dry:
                return row(
                    "duration_vs_kernel",
                    name,
                    "fail",
                    f"{mode}: rows labelled {sorted(labels)}",
                    f"(cuda, nccl, device_event, async={async_op})",
                )
            durations = rows["duration_us"].tolist()
            if not acts and self.world == 1 and kind in IN_PLACE:
                # NCCL runs nothing for an in-place collective on one rank: a stream-order self-check
                med = statistics.median(durations)
                data[mode] = {"n": len(durations), "commpatch_med_us": med, "kernels": 0}
                parts.append(f"{mode}: no device work (1 rank, in place), commpatch {med:.1f} us")
                if mode == "queued":
                    ok = ok and med <= SELF_CHECK_US
                continue
            if len(acts) != len(durations):
                what = (
                    "no NCCL kernel in the profiler trace (is CUPTI available? see docs/gpu-validation.md)"
                    if not acts
                    else f"{len(durations)} rows against {len(acts)} kernels {sorted({n for _, _, n in acts})[:3]}"
                )
                return row("duration_vs_kernel", name, "fail", f"{mode}: {what}", "one kernel per call")
            c = compare(durations, [e - s for s, e, _ in acts], TOL[mode], self.host_us if mode == "idle" else None)
            c["kernel_names"] = sorted({n.split("(")[0] for _, _, n in acts})
            data[mode] = c
            word = KERNEL_WORD[kind]
            note = f"kernel names lack {word!r}: {c['kernel_names'][:2]}"
            if self.world > 1 and not self.dry and not any(word in n for n in c["kernel_names"]) and note not in notes:
                notes.append(note)  # e.g. NCCL's generic kernel: the pairing by order still holds
            parts.append(f"{mode} {describe(c)}")
            ok = ok and c["ok"]
        threshold = f"idle {bound(TOL['idle'])}; queued {bound(TOL['queued'])}"
        if any(d.get("kernels") == 0 for d in data.values()):
            threshold = f"queued <= {SELF_CHECK_US:g} us (the 1 ms sleep before it not counted)"
        measured = "; ".join(parts + notes)
        return row("duration_vs_kernel", name, "pass" if ok else "fail", measured, threshold, **data)

    # ---- check 2
    def own_time(self) -> list[dict]:
        kind = "all_reduce" if self.world > 1 else "all_gather_into_tensor"  # 1 rank: NCCL copies (out of place)
        big_bytes = (4 << 20) if self.dry else (256 << 20) if self.world > 1 else (1 << 30)
        name = f"{CHECKS['own_vs_duration']}: 4 KiB {kind} behind {human(big_bytes)}"
        try:
            big, small = self.issuer(kind, big_bytes), self.issuer(kind, 4096)
            for _ in range(2):
                wb, ws = big(True), small(True)
                wb.wait()
                ws.wait()
            self.sync()
            self.commpatch.reset()
            iters = max(5, self.args.iters // 2)
            with self.profile() as prof:
                for _ in range(iters):
                    wb, ws = big(True), small(True)  # the small one queues behind the big one on NCCL's stream
                    wb.wait()
                    ws.wait()
                self.sync()
            rows, acts = self.rows_of(kind), self.activities(prof)
            if len(rows) != 2 * iters or len(acts) != 2 * iters:
                return [
                    row(
                        "own_vs_duration",
                        name,
                        "fail",
                        f"{len(rows)} rows, {len(acts)} kernels",
                        f"{2 * iters} of each",
                    )
                ]
            small_rows = rows.iloc[1::2]
            big_k = [e - s for s, e, _ in acts[0::2]]
            small_k = [e - s for s, e, _ in acts[1::2]]
            c = compare(small_rows["own_us"].tolist(), small_k, TOL["own"])
            dur = statistics.median(small_rows["duration_us"].tolist())
            queue_ok = dur >= QUEUE_FRACTION * statistics.median(big_k)
            measured = f"own {describe(c)}; duration {dur:.1f} us vs the large kernel {statistics.median(big_k):.1f} us"
            threshold = f"own {bound(TOL['own'])}; duration >= {QUEUE_FRACTION:.0%} of the large kernel"
            return [
                row(
                    "own_vs_duration",
                    name,
                    "pass" if c["ok"] and queue_ok else "fail",
                    measured,
                    threshold,
                    own=c,
                    small_duration_med_us=dur,
                    big_kernel_med_us=statistics.median(big_k),
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("own_vs_duration", name, exc)]

    # ---- checks 3 and 4
    def model(self):
        torch = self.torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        width, layers, batch = (64, 2, 8) if self.dry else (2048, 4, 128) if self.args.quick else (4096, 8, 256)
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        net = torch.nn.Sequential(*mods).to(self.device)
        ddp = DDP(net, device_ids=None if self.dry else [self.device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        x = torch.randn(batch, width, device=self.device)
        y = torch.randn(batch, width, device=self.device)

        def step():
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step.config = {"width": width, "layers": layers, "batch": batch, "ddp": True}
        return step

    def step_time(self, steps: dict) -> list[dict]:
        name = f"{CHECKS['step_time']}: DDP {self.world} rank(s), with / without commpatch"
        try:
            cp = self.commpatch
            n, rounds = (10, 4) if self.args.quick else (20, 8)
            times = {"plain": [], "commpatch": []}
            for r in range(rounds + 1):  # round 0 warms both up
                for kind in ("plain", "commpatch") if r % 2 else ("commpatch", "plain"):
                    if kind == "commpatch":
                        cp.enable(output=self.output)
                    else:
                        cp.disable()
                    self.sync()
                    self.dist.barrier()
                    start, end = self.event(), self.event()
                    start.record()
                    for _ in range(n):
                        steps[kind]()
                    end.record()
                    end.synchronize()  # outside the timed span
                    if r:
                        times[kind].append(start.elapsed_time(end) / n)
            cp.enable(output=self.output)
            ratios = [c / p for c, p in zip(times["commpatch"], times["plain"])]
            ratio = statistics.median(ratios)
            measured = (
                f"x{ratio:.4f} (plain {statistics.median(times['plain']):.3f} ms, commpatch "
                f"{statistics.median(times['commpatch']):.3f} ms; round ratios {min(ratios):.3f}-{max(ratios):.3f}, "
                f"{rounds} rounds x {n} steps)"
            )
            return [
                row(
                    "step_time",
                    name,
                    "pass" if ratio <= STEP_RATIO_MAX else "fail",
                    measured,
                    f"median paired ratio <= {STEP_RATIO_MAX}",
                    ratio=ratio,
                    ratios=ratios,
                    times_ms=times,
                    model=steps["plain"].config,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("step_time", name, exc)]

    def no_host_sync(self, steps: dict) -> list[dict]:
        name = f"{CHECKS['no_host_sync']}: CUDA runtime and Python synchronize calls in the hot loop"
        try:
            torch, cp = self.torch, self.commpatch
            issuers = [self.issuer(kind, 1 << 20) for kind in KINDS]
            counts = {}
            for kind in ("plain", "commpatch"):
                if kind == "commpatch":
                    cp.enable(output=self.output)
                else:
                    cp.disable()
                for _ in range(2):
                    self._hot_loop(steps[kind], issuers)  # warm-up (DDP's first steps, the event pool)
                self.sync()
                with self.profile() as prof, count_python_syncs(torch) as py:
                    with torch.profiler.record_function(LOOP_LABEL):
                        self._hot_loop(steps[kind], issuers)
                    frozen = dict(py)  # what ran inside the loop only
                    self.sync()
                counts[kind] = {"runtime": runtime_syncs(prof), "python": frozen}
            cp.enable(output=self.output)
            plain, patched = counts["plain"], counts["commpatch"]
            seen = plain["runtime"].pop("_launches") + patched["runtime"].pop("_launches")
            if not seen and not self.dry:
                return [
                    row(
                        "no_host_sync",
                        name,
                        "fail",
                        "the trace has no CUDA runtime calls at all (CUPTI?)",
                        "runtime calls visible",
                        counts=counts,
                    )
                ]
            equal = plain == patched
            differ = {
                k: (plain[part][k], patched[part][k])
                for part in ("runtime", "python")
                for k in plain[part]
                if plain[part][k] != patched[part][k]
            }
            measured = (
                f"runtime synchronize calls plain {sum(plain['runtime'].values())} / commpatch "
                f"{sum(patched['runtime'].values())}; python plain {sum(plain['python'].values())} / "
                f"commpatch {sum(patched['python'].values())}" + (f"; differ: {differ}" if differ else "")
            )
            return [
                row(
                    "no_host_sync",
                    name,
                    "pass" if equal else "fail",
                    measured,
                    "equal with and without commpatch",
                    counts=counts,
                    note="torch.Event / torch.Stream (what commpatch uses) are immutable C types: their "
                    "synchronize() is seen only in the runtime trace",
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("no_host_sync", name, exc)]

    def _hot_loop(self, step, issuers) -> None:
        for _ in range(3):
            step()
        for issue in issuers:
            issue(False)
            issue(True).wait()

    # ---- check 5
    def nccl_timing(self) -> list[dict]:
        """A group created with TORCH_NCCL_ENABLE_TIMING=1 (ProcessGroupNCCL reads it when a group is
        made) and a fresh commpatch session (commpatch reads it when its session is made)."""
        from commpatch import session  # the public API has no way to make commpatch re-read the variable

        title = CHECKS["nccl_timing"]
        kind = "all_reduce" if self.world > 1 else "all_gather_into_tensor"
        os.environ[NCCL_TIMING_ENV] = "1"
        try:
            group = self.dist.new_group(list(range(self.world)), backend="gloo" if self.dry else "nccl")
            session.new_default()
            self.commpatch.enable(output=os.path.join(self.outdir, "nccl_timing_rank{rank}.csv"))
        except Exception as exc:  # noqa: BLE001
            return [failed_row("nccl_timing", f"{title}: set-up", exc)]
        finally:
            os.environ.pop(NCCL_TIMING_ENV, None)
        out = []
        name = f"{title}: labels, and log() waits for the async row"
        try:
            issue = self.issuer(kind, 1 << 20, group)
            for _ in range(WARMUP):
                issue(True).wait()
            self.sync()
            self.commpatch.reset()
            issue(False)
            self.busy(LOG_WAIT_US)  # the async call's kernel runs >= 50 ms from now
            issue(True).wait()
            rows = self.rows_of(kind)  # log() resolves with block=True: it must wait for that kernel
            labels = [
                (bool(a), t, d)
                for a, t, d in zip(rows["async_op"], rows["timing"].astype(str), rows["duration_us"].round(1))
            ]
            ok = [x[:2] for x in labels] == [(False, "device_event"), (True, "nccl")] and all(d > 0 for *_, d in labels)
            out.append(
                row(
                    "nccl_timing",
                    name,
                    "pass" if ok else "fail",
                    f"(async, timing, duration_us) {labels}",
                    "sync device_event, async nccl; durations > 0 when log() returns",
                )
            )
        except Exception as exc:  # noqa: BLE001
            out.append(failed_row("nccl_timing", name, exc))
        for nbytes in self.args.sizes:
            name = f"{title}: {kind} {human(nbytes)} async"
            try:
                parts, data, ok = [], {}, True
                for mode, tol in (("idle", TOL["idle"]), ("queued", TOL["nccl"])):
                    # idle: NCCL's start event is recorded on its stream before the kernel's launch
                    rows, acts = self.block(
                        kind, self.issuer(kind, nbytes, group), True, mode == "queued", self.args.iters
                    )
                    if set(rows["timing"].astype(str)) != {"nccl"}:
                        parts.append(f"{mode}: timing {sorted(set(rows['timing'].astype(str)))}")
                        ok = False
                        continue
                    hosts = self.host_us if mode == "idle" else None
                    c = data[mode] = compare(rows["duration_us"].tolist(), [e - s for s, e, _ in acts], tol, hosts)
                    parts.append(f"{mode} {describe(c)}")
                    ok = ok and c["ok"]
                threshold = f"idle {bound(TOL['idle'])}; queued {bound(TOL['nccl'])}"
                out.append(row("nccl_timing", name, "pass" if ok else "fail", "; ".join(parts), threshold, **data))
            except Exception as exc:  # noqa: BLE001
                out.append(failed_row("nccl_timing", name, exc))
        return out


@contextlib.contextmanager
def count_python_syncs(torch):
    """Count calls to torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    and torch.accelerator.synchronize while inside."""
    counts: dict[str, int] = {}
    targets = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
    ]
    if hasattr(getattr(torch, "accelerator", None), "synchronize"):
        targets.append((torch.accelerator, "synchronize", "torch.accelerator.synchronize"))
    saved = []
    for owner, attr, label in targets:
        original = getattr(owner, attr)
        own = attr in vars(owner)  # restored as it was: own attribute, or inherited
        counts[label] = 0

        def wrapper(*a, _original=original, _label=label, **k):
            counts[_label] += 1
            return _original(*a, **k)

        saved.append((owner, attr, vars(owner)[attr] if own else None))
        setattr(owner, attr, wrapper)
    try:
        yield counts
    finally:
        for owner, attr, original in saved:
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def runtime_syncs(prof) -> dict:
    """CUDA runtime synchronize calls the profiler saw (CPU side) inside the LOOP_LABEL range, and
    '_launches': how many runtime calls it saw there at all (0: the trace cannot tell)."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    spans = [e.time_range for e in events if e.name == LOOP_LABEL]
    lo, hi = (spans[0].start, spans[0].end) if spans else (-math.inf, math.inf)
    counts = {name: 0 for name in SYNC_CALLS}
    counts["_launches"] = 0
    for e in events:
        if not lo <= e.time_range.start <= hi:
            continue
        if e.name.startswith("cu"):
            counts["_launches"] += 1
        for name in SYNC_CALLS:
            if e.name.startswith(name):  # CUPTI may add a suffix (cudaStreamSynchronize_v3020)
                counts[name] += 1
    return counts


# ------------------------------------------------------------------ running
def init_group(torch, dist, backend: str, store_dir: str, device=None) -> None:
    """torchrun's environment when present, else a 1-rank group on a file store."""
    import datetime

    kwargs = {"timeout": datetime.timedelta(minutes=10)}
    if device is not None:
        kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU (torch >= 2.3)
    if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        kwargs.update(init_method=f"file://{os.path.join(store_dir, 'store')}", rank=0, world_size=1)
    try:
        dist.init_process_group(backend, **kwargs)
    except TypeError:  # an older torch without device_id
        kwargs.pop("device_id", None)
        dist.init_process_group(backend, **kwargs)


def gpu_rows(args, torch, dist, outdir: str) -> list[dict]:
    gpu = Gpu(args, torch, dist, commpatch, outdir)
    commpatch.enable(output=gpu.output)
    rows = gpu.durations_vs_kernels()
    rows += gpu.own_time()
    try:
        steps = {"plain": gpu.model(), "commpatch": gpu.model()}  # identical; the plain one never runs patched
    except Exception as exc:  # noqa: BLE001
        rows += [
            failed_row("step_time", CHECKS["step_time"], exc),
            failed_row("no_host_sync", CHECKS["no_host_sync"], exc),
        ]
    else:
        rows += gpu.step_time(steps)
        rows += gpu.no_host_sync(steps)
    rows += gpu.nccl_timing()
    if gpu.world == 1:  # what only several GPUs can show is said as not run, never as passed
        rows.append(
            row(
                "multi_gpu",
                CHECKS["multi_gpu"],
                "skip",
                "not run: 1 rank (NCCL's ring / tree kernels between GPUs, waits for peers, cross-rank "
                "timing); torchrun --nproc-per-node N on N GPUs runs every check across them",
                "-",
            )
        )
    commpatch.disable()
    return rows


def cpu_smoke(torch, dist, store_dir: str) -> str:
    """Without CUDA: the plumbing on gloo (commpatch records the kit's collectives); validates nothing."""
    init_group(torch, dist, "gloo", store_dir)
    try:
        world = dist.get_world_size()
        commpatch.enable(output="none")
        t, big = torch.zeros(8 * world), torch.zeros(8 * world)
        calls = [
            lambda a: dist.all_reduce(t, async_op=a),
            lambda a: dist.all_gather_into_tensor(big, t[:8], async_op=a),
            lambda a: dist.reduce_scatter_tensor(t[:8], big, async_op=a),
            lambda a: dist.broadcast(t, src=0, async_op=a),
        ]
        for call in calls:
            call(False)
            call(True).wait()
        df = commpatch.log()
        commpatch.disable()
        got = df[df["op"].isin(KINDS)]
        return (
            f"gloo smoke run (plumbing only): commpatch recorded {len(got)} of {2 * len(calls)} collectives "
            f"on {world} rank(s), timings {sorted(set(got['timing'].astype(str)))}"
        )
    finally:
        dist.destroy_process_group()


def run_checks(args, torch, dist, store_dir: str, backend: str, device):
    """Every rank runs the checks; rank 0 gets every rank's rows. Returns (rows per rank, environment)."""
    init_group(torch, dist, backend, store_dir, device=device)
    outdir = tempfile.mkdtemp(prefix="commpatch-kit-")
    rows = gpu_rows(args, torch, dist, outdir)
    env = environment(torch, dist.get_world_size())
    env["commpatch_logs"] = outdir
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rows)
    dist.destroy_process_group()
    return per_rank, env


def dry_run_verdict(merged: list[dict]) -> tuple[int, str]:
    """--dry-run-cpu: nothing is validated; every row becomes a skip, except checks that raised."""
    raised = 0
    for r in merged:
        if any(x["data"].get("raised") for x in r["ranks"]):
            raised += 1
            r["status"] = "fail"
        else:
            r["status"], r["measured"] = "skip", f"dry run (CPU, gloo; meaningless): {r['measured']}"
    if raised:
        return (
            1,
            f"DRY RUN: {raised} checks raised (a bug in the kit: see their tracebacks in the JSON); nothing validated.",
        )
    return 0, "DRY RUN on CPU with gloo: every check's code ran; NOTHING VALIDATED."


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="docs/gpu-validation.md explains every check."
    )
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="message sizes S as nccl-tests counts them (default 8K,256K,8M,128M; --quick 64K,16M)",
    )
    p.add_argument("--iters", type=int, default=None, help="measured calls per size and mode (default 40; --quick 10)")
    p.add_argument("--json", metavar="PATH", help="write the machine-readable results here (rank 0)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, calls, rounds and a smaller model")
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="for the kit's developers: run every check's code on CPU tensors and gloo (tiny sizes); "
        "numbers are meaningless, every check reports skip, exit 1 only if the kit itself raised",
    )
    args = p.parse_args(argv)
    if args.dry_run_cpu:
        args.sizes = args.sizes or [4096]
        args.iters = args.iters or 3
    if args.sizes is None:
        args.sizes = parse_sizes("64K,16M" if args.quick else "8K,256K,8M,128M")
    if args.iters is None:
        args.iters = 10 if args.quick else 40
    if args.iters < 2:
        p.error("--iters: at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    notes = []
    with tempfile.TemporaryDirectory(prefix="commpatch-kit-store-") as store_dir:
        reason = None
        if args.dry_run_cpu:
            per_rank, env = run_checks(args, torch, dist, store_dir, "gloo", None)
        elif not torch.cuda.is_available():
            reason = f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        elif not dist.is_nccl_available():
            reason = f"NCCL is not available in this torch build ({torch.__version__})"
        if reason and not args.dry_run_cpu:
            rows = skip_all(reason)
            try:
                notes.append(cpu_smoke(torch, dist, store_dir))
            except Exception as exc:  # noqa: BLE001 - the smoke run is reported, the checks stay skipped
                notes.append(f"gloo smoke run failed: {type(exc).__name__}: {exc}")
            env = environment(torch, int(os.environ.get("WORLD_SIZE", "1")))
            per_rank = [rows]
        elif not args.dry_run_cpu:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                print(
                    f"validate.py: LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) are visible: "
                    "run at most one process per GPU",
                    file=sys.stderr,
                )
                return 2
            torch.cuda.set_device(local)
            per_rank, env = run_checks(args, torch, dist, store_dir, "nccl", torch.device("cuda", local))
    merged = merge_ranks(per_rank)
    status, closing = verdict(merged)
    if args.dry_run_cpu:
        status, closing = dry_run_verdict(merged)
    if rank == 0:
        print(
            f"# commpatch GPU validation kit v{KIT_VERSION}: torch {env['torch']}, CUDA {env['cuda_build']}, "
            f"{env.get('gpu', 'no GPU')} x{env['world_size']}, NCCL {env.get('nccl', '-')}, "
            f"sizes {','.join(human(s) for s in args.sizes)}, {args.iters} iters"
        )
        print(render_table(merged))
        for note in notes:
            print(note)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    clean(
                        {
                            "environment": env,
                            "args": vars(args),
                            "checks": merged,
                            "notes": notes,
                            "exit_status": status,
                            "summary": closing,
                            "validated": any(r["status"] != "skip" for r in merged),
                        }
                    ),
                    f,
                    indent=1,
                    default=str,
                    allow_nan=False,
                )
            print(f"results: {args.json}")
        print(closing)
    return status


if __name__ == "__main__":
    sys.exit(main())
