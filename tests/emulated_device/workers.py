"""Multi-process workers for tests/test_emulated_device.py (module-level: spawned ranks import them).

``run_emu_ranks(fn, world_size)`` runs ``fn(rank, world_size, **kwargs)`` in real processes whose
default group is ``init_process_group("cpu:gloo,emu:emustream")`` on the emulated device.
"""

from __future__ import annotations

import os
import tempfile
import time

from tests.multiproc import run_ranks

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def _emu_entry(rank, world_size, target, store_path, emu_pg_timeout, kwargs):
    """Runs inside tests.multiproc's gloo-initialised rank: swap in the cpu:gloo,emu:emustream group."""
    import datetime

    import torch
    import torch.distributed as dist

    from tests import emulated_device as emu
    from tests.emulated_device import pg

    emu.load()
    pg.register()
    dist.destroy_process_group()  # the plain gloo group tests.multiproc made
    dist.init_process_group(
        f"cpu:gloo,{emu.BACKEND}:{pg.NAME}",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=emu_pg_timeout),
    )
    try:
        return target(rank, world_size, **kwargs)
    finally:
        torch.accelerator.synchronize()  # nothing left queued when the group goes away
        dist.destroy_process_group()


def run_emu_ranks(fn, world_size=2, timeout=60, pg_timeout=30, **kwargs):
    """``fn(rank, world_size, **kwargs)`` in ``world_size`` spawned ranks on cpu:gloo,emu:emustream;
    a hang fails after ``timeout`` seconds (tests.multiproc kills the ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(
            _emu_entry,
            world_size,
            timeout=timeout,
            pg_timeout=pg_timeout,
            target=fn,
            store_path=os.path.join(tmp, "emu_store"),
            emu_pg_timeout=pg_timeout,
            kwargs=kwargs,
        )


def _timed_events(torch, n=2):
    return [torch.Event(device="emu", enable_timing=True) for _ in range(n)]


# ------------------------------------------------------------------ single process: the device itself
def device_checks(rank, world_size):
    import torch

    from tests import emulated_device as emu

    emu.load()
    out = {}
    acc = torch.accelerator
    out["accelerator"] = (acc.is_available(), str(acc.current_accelerator()), acc.device_count())
    out["stream_type"] = type(acc.current_stream(torch.device("emu", 0))).__name__
    x = torch.ones(1024, device="emu")
    emu.reset_host_waits()

    # 1. events time device work; the host does not wait
    start, end = _timed_events(torch)
    t0 = time.perf_counter()
    start.record()
    emu.sleep(x, 150)
    end.record()
    out["host_ms"] = (time.perf_counter() - t0) * 1e3
    out["query_while_busy"] = end.query()
    try:
        start.elapsed_time(end)
        out["elapsed_before_done"] = "no error"
    except (RuntimeError, ValueError) as e:
        out["elapsed_before_done"] = str(e).splitlines()[0]
    out["waits_before_sync"] = emu.host_waits()
    end.synchronize()
    out["waits_after_sync"] = emu.host_wait_counts()
    out["query_after_sync"] = end.query()
    out["elapsed_ms"] = start.elapsed_time(end)
    untimed = torch.Event(device="emu")
    untimed.record()
    untimed.synchronize()
    try:
        start.elapsed_time(untimed)
        out["elapsed_untimed"] = "no error"
    except (RuntimeError, ValueError) as e:
        out["elapsed_untimed"] = str(e).splitlines()[0]

    # 2. a second stream, wait_event, stream / device synchronize
    emu.reset_host_waits()
    side = torch.Stream(device="emu")
    main = acc.current_stream(torch.device("emu", 0))
    a, b, c = _timed_events(torch, 3)
    a.record(main)
    with side:
        emu.sleep(x, 100)
        b.record()
    main.wait_event(b)
    c.record(main)
    t0 = time.perf_counter()
    main.synchronize()
    out["stream_sync_ms"] = (time.perf_counter() - t0) * 1e3
    out["wait_event_ms"] = a.elapsed_time(c)
    out["side_id"] = side.stream_id
    emu.sleep(x, 50)
    acc.synchronize()
    out["waits_stream_device"] = emu.host_wait_counts()

    # 3. aten ops are ordered after queued work (a Python job writes, then an op reads)
    emu.reset_host_waits()
    y = torch.zeros(4, device="emu")
    view = emu.cpu_view(y)
    emu.sleep(y, 80)
    emu.enqueue(lambda: view.fill_(7.0))
    out["op_after_job"] = (y + 1).cpu().tolist()
    out["op_waits"] = emu.host_wait_counts()["op_wait"]
    out["matmul_ok"] = bool(
        torch.allclose(
            (torch.arange(6.0).view(2, 3).to("emu") @ torch.ones(3, 2, device="emu")).cpu(),
            torch.arange(6.0).view(2, 3) @ torch.ones(3, 2),
        )
    )

    # 4. the capture switch
    out["capturing"] = [main.is_capturing()]
    with emu.capturing():
        out["capturing"].append(acc.current_stream(torch.device("emu", 0)).is_capturing())
    out["capturing"].append(main.is_capturing())

    # 5. exit with a Python job still queued (the atexit drain must make this safe)
    emu.enqueue(lambda: time.sleep(0.05))
    out["errors"] = emu.take_errors()
    return out


# ------------------------------------------------------------------ collectives on the device
def collective_timing(rank, world_size, busy_ms=150):
    """Rank 0's stream is busy for busy_ms before the all_reduce; every rank times the collective
    with events on its current stream, and the host calls."""
    import torch
    import torch.distributed as dist

    from tests import emulated_device as emu

    x = torch.full((256,), float(rank + 1), device="emu")
    dist.all_reduce(x)  # warm-up: connections, first-call costs
    torch.accelerator.synchronize()
    dist.barrier()
    x.fill_(float(rank + 1))
    emu.reset_host_waits()
    start, end, after_cb = _timed_events(torch, 3)
    if rank == 0:
        emu.sleep(x, busy_ms)
    start.record()
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    host_call_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    work.wait()
    host_wait_ms = (time.perf_counter() - t0) * 1e3
    end.record()

    def cb(fut):
        after_cb.record()  # on the callback's current stream
        return fut.value()

    chained = work.get_future().then(cb)
    waits_before = emu.host_waits()
    chained.wait()
    end.synchronize()
    after_cb.synchronize()
    expected = world_size * (world_size + 1) / 2
    return {
        "host_call_ms": host_call_ms,
        "host_wait_ms": host_wait_ms,
        "device_ms": start.elapsed_time(end),
        "cb_ms_from_start": start.elapsed_time(after_cb),  # the then() callback's device work
        "waits_before_sync": waits_before,
        "waits_after_sync": emu.host_wait_counts(),
        "correct": bool((x.cpu() == expected).all()),
        "errors": emu.take_errors(),
    }


def collective_coverage(rank, world_size):
    """Every supported collective on emu tensors, checked against the expected values."""
    import torch
    import torch.distributed as dist

    from tests import emulated_device as emu

    ok = {}
    n = world_size
    t = torch.full((4,), float(rank), device="emu")
    dist.all_reduce(t)
    ok["all_reduce"] = t.cpu().tolist() == [float(sum(range(n)))] * 4

    t = torch.full((3,), float(rank), device="emu")
    dist.broadcast(t, src=n - 1)
    ok["broadcast"] = t.cpu().tolist() == [float(n - 1)] * 3

    outs = [torch.empty(2, device="emu") for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(rank), device="emu"))
    ok["all_gather"] = [o.cpu().tolist() for o in outs] == [[float(r)] * 2 for r in range(n)]

    big = torch.empty(2 * n, device="emu")
    dist.all_gather_into_tensor(big, torch.full((2,), float(rank), device="emu"))
    ok["all_gather_into_tensor"] = big.cpu().tolist() == [float(r) for r in range(n) for _ in range(2)]

    inp = torch.arange(2.0 * n, device="emu") + rank
    out = torch.empty(2, device="emu")
    dist.reduce_scatter_tensor(out, inp)
    base = torch.arange(2.0 * n) * n + sum(range(n))
    ok["reduce_scatter_tensor"] = out.cpu().tolist() == base[2 * rank : 2 * rank + 2].tolist()

    out = torch.empty(2, device="emu")
    dist.reduce_scatter(out, [torch.full((2,), float(rank + r), device="emu") for r in range(n)])
    ok["reduce_scatter"] = out.cpu().tolist() == [float(sum(q + rank for q in range(n)))] * 2

    dist.barrier()
    ok["barrier"] = True

    if n >= 2:
        if rank == 0:
            dist.send(torch.full((3,), 42.0, device="emu"), dst=1)
            ok["send_recv"] = True
        elif rank == 1:
            r = torch.zeros(3, device="emu")
            dist.recv(r, src=0)
            ok["send_recv"] = r.cpu().tolist() == [42.0] * 3
        else:
            ok["send_recv"] = True
    # the CPU half of the group is still gloo
    c = torch.ones(2)
    dist.all_reduce(c)
    ok["cpu_all_reduce"] = c.tolist() == [float(n)] * 2
    ok["errors"] = emu.take_errors()
    return ok


# ------------------------------------------------------------------ DDP
def ddp_train(rank, world_size, steps=3):
    """The same tiny model trained with DDP on emu and on CPU (same group): identical results?"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests import emulated_device as emu

    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            xb = torch.randn(4, 8, generator=g).to(device)
            yb = torch.randn(4, 2, generator=g).to(device)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    emu_losses, emu_params = train("emu")
    cpu_losses, cpu_params = train("cpu")
    # ranks hold identical parameters after DDP: compare across ranks too
    flat = torch.cat([p.reshape(-1) for p in emu_params])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "emu_losses": emu_losses,
        "cpu_losses": cpu_losses,
        "identical": all(torch.equal(a, b) for a, b in zip(emu_params, cpu_params)),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(emu_params, cpu_params)),
        "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
        "errors": emu.take_errors(),
    }


# ------------------------------------------------------------------ commpatch on the device
def _rows(df, cols=("op", "async_op", "device", "backend", "timing", "duration_us", "own_us")):
    return df[list(cols)].to_dict("records")


def commpatch_device(rank, world_size, busy_ms=150, calls=10_000):
    """What commpatch records on the emulated device: sync and async collectives timed on the
    device while rank 0's stream is busy; host waits; queued calls on a group with its own stream
    (own_us); capture; the event pool over many calls."""
    import torch
    import torch.distributed as dist

    import commpatch
    from commpatch.session import default
    from tests import emulated_device as emu
    from tests.emulated_device import pg

    out = {}
    x = torch.ones(1024, device="emu")
    dist.all_reduce(x)
    torch.accelerator.synchronize()
    os.environ[pg.COMM_STREAM_ENV] = "1"
    comm_group = dist.new_group(backend=f"cpu:gloo,{emu.BACKEND}:{pg.NAME}")  # NCCL-like: a stream of its own
    del os.environ[pg.COMM_STREAM_ENV]
    dist.all_reduce(x, group=comm_group)
    torch.accelerator.synchronize()
    commpatch.enable(output="none")
    timing = default().timing
    try:
        # 1. a busy rank 0: peers' collectives last >= busy_ms on the device; the host returns at once
        small = torch.ones(1, device="emu")
        dist.barrier()
        emu.reset_host_waits()
        if rank == 0:
            emu.sleep(x, busy_ms)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        out["sync_host_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        out["async_host_ms"] = (time.perf_counter() - t0) * 1e3
        work.wait()  # the stream waits, not the host
        # 2. queued: a long collective then a small one on the group's own stream
        if rank == 0:
            emu.sleep(x, busy_ms)  # the comm stream waits for it: so do the peers
        w1 = dist.all_reduce(x, group=comm_group, async_op=True)
        w2 = dist.all_reduce(small, group=comm_group, async_op=True)
        w1.wait()
        w2.wait()
        out["waits_in_calls"] = emu.host_wait_counts()
        df = commpatch.log()  # resolves: the first host wait allowed
        out["rows"] = _rows(df)
        # 3. capture: no event recorded, queried or synchronized; rows say timing=none
        torch.accelerator.synchronize()
        commpatch.reset()
        emu.sleep(x, 50)
        dist.all_reduce(x)  # pending across the capture
        created, pending = timing.created, timing.in_flight()
        emu.reset_host_waits()
        with emu.capturing():
            dist.all_reduce(x)
            dist.all_reduce(x, async_op=True).wait()
            timing.resolve(block=True)  # must not touch the pending measurement
            out["capture"] = {
                "created": timing.created - created,
                "pending": timing.in_flight() - pending,
                "waits": emu.host_waits(),
            }
        out["capture_rows"] = _rows(commpatch.log())
        # 4. the pool over many calls (the user's code reads a value now and then, like loss.item())
        commpatch.reset()
        torch.accelerator.synchronize()
        created, peaks, peak = [], [], 0
        for i in range(calls):
            dist.all_reduce(small)
            peak = max(peak, timing.in_flight())  # the most measurements in flight so far
            if i % 100 == 99:
                small.cpu()
            if i in (calls // 2 - 1, calls - 1):  # right after a read
                created.append(timing.created)
                peaks.append(peak)
        out["pool"] = created
        out["peak_in_flight"] = peaks
        out["pool_rows"] = len(commpatch.log())
        out["events_created"] = timing.created
        out["events_accounted"] = (
            sum(len(p) for p in timing.pools.values()) + 2 * timing.in_flight() + len(timing.last_end)
        )
    finally:
        commpatch.disable()
    torch.accelerator.synchronize()
    out["errors"] = emu.take_errors() + [f"{k}: {v}" for k, v in commpatch.internal_errors().items()]
    return out


def commpatch_frameworks(rank, world_size):
    """DDP (buckets through the comm hook) and FSDP2 on the device, and NCCL's _get_duration path
    with a stand-in work: the rows commpatch records."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch
    from commpatch.session import default
    from tests import emulated_device as emu

    out = {}
    commpatch.enable(output="none")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to("emu")
        ddp = DDP(model, bucket_cap_mb=0.0001)  # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            ddp(torch.randn(4, 8).to("emu")).sum().backward()
            opt.step()
        df = commpatch.log()
        out["ddp_rows"] = _rows(df[df["bucket"] >= 0], ("op", "device", "backend", "timing", "duration_us"))
        out["ddp_internal_rows"] = _rows(df[df["bucket"] < 0], ("op", "device", "timing"))  # constructor, rebuild
        commpatch.reset()
        try:
            from tests.torch_compat import fully_shard as _fully_shard

            fully_shard = _fully_shard()

            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to("emu")
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            model(torch.randn(4, 8).to("emu")).sum().backward()
            torch.accelerator.synchronize()
            out["fsdp_rows"] = _rows(commpatch.log(), ("op", "device", "backend", "timing", "duration_us"))
        except Exception as exc:  # noqa: BLE001 - reported, the test decides
            out["fsdp_error"] = f"{type(exc).__name__}: {exc}"
        commpatch.reset()
        # NCCL's path, with a stand-in work: ProcessGroupNCCL's works answer _get_duration() (kernel
        # time, from events around the kernel on NCCL's stream) when TORCH_NCCL_ENABLE_TIMING=1
        from commpatch.data.schema import T_NCCL
        from commpatch.record.log import GroupInfo

        timing, log = default().timing, default().log
        log.groups.append(GroupInfo("nccl-stand-in", 2, "0-1", "cpu:gloo,cuda:nccl", ("gloo", "nccl", "gloo")))
        gid = len(log.groups) - 1
        x = torch.ones(64, device="emu")
        kernel = [torch.Event(device="emu", enable_timing=True) for _ in range(2)]

        class StandInWork:
            def is_completed(self):
                return kernel[1].query()

            def wait(self):  # as NCCL's: the stream waits, not the host
                torch.accelerator.current_stream(x.device).wait_event(kernel[1])

            def _get_duration(self):
                return kernel[0].elapsed_time(kernel[1])

        timing.nccl_timing = True
        started = timing.device_start(x)
        emu.sleep(x, 20)  # queued work before the "kernel"
        kernel[0].record()
        emu.sleep(x, 40)  # the "kernel"
        kernel[1].record()
        code = timing.device_end(10**9, gid, started, StandInWork(), async_op=True)
        pending_before = len(timing.nccl_pending)
        timing.resolve(block=True)
        out["nccl"] = {
            "code_is_nccl": code == T_NCCL,
            "pending_before": pending_before,
            "pending_after": len(timing.nccl_pending),
            "duration_ms": log.done.pop(10**9, None) / 1e6,
        }
        log.groups.pop()
    finally:
        default().timing.nccl_timing = False
        commpatch.disable()
    torch.accelerator.synchronize()
    out["errors"] = emu.take_errors() + [f"{k}: {v}" for k, v in commpatch.internal_errors().items()]
    return out


def collectives(rank, world_size):
    """collective_timing, collective_coverage and commpatch_device in one set of ranks (one spawn
    per world size)."""
    return {
        "timing": collective_timing(rank, world_size),
        "coverage": collective_coverage(rank, world_size),
        "commpatch": commpatch_device(rank, world_size, calls=10_000 if world_size == 2 else 1_000),
    }


def commpatch_behind(rank, world_size, calls=2000, sleep_ms=3000):
    """``calls`` all_reduces issued while the device is ``sleep_ms`` behind the host: how many pending
    measurements the resolves walked over in all (each new event used to walk every one still in
    flight: quadratic in the calls queued), and the rows' durations once the device caught up."""
    import torch
    import torch.distributed as dist

    import commpatch
    from commpatch.session import default
    from tests import emulated_device as emu

    commpatch.enable(output="none")
    timing = default().timing
    try:
        t = torch.ones(64, device="emu")
        emu.sleep(t, sleep_ms)
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        issue_s = time.perf_counter() - t0
        in_flight = timing.in_flight()
        examined_while_behind = timing.examined
        df = commpatch.log()  # waits for the device
    finally:
        commpatch.disable()
    rows = df[df["op"] == "all_reduce"]
    return {
        "examined_while_behind": examined_while_behind,  # measurements taken in or queried by resolves
        "examined": timing.examined,
        "issue_s": issue_s,
        "in_flight_after_issue": in_flight,
        "rows": len(rows),
        "timed": int((rows["duration_us"] > 0).sum()),
        "events_created": timing.created,
    }


def funcol_device_wait(rank, world_size, late_ms=60, steps=4):
    """Functional collectives on the device (as DTensor / tensor parallel issue them), the group on a
    stream of its own (``pg.COMM_STREAM_ENV``, as NCCL's): rank 1 queues ``late_ms`` of device work
    before each of its all-reduces, so rank 0's stream stalls at its wait for the result while its
    host returns at once. Eager ``funcol.all_reduce`` + ``AsyncCollectiveTensor.wait()``, then the
    ops a compiled graph calls (``_c10d_functional.all_reduce`` / ``wait_tensor``, through the
    kernels of ``integrations.compiled``). Returns the rows and the steps table."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import commpatch
    from commpatch.analysis import per_step
    from commpatch.integrations import compiled
    from commpatch.session import default
    from tests import emulated_device as emu

    commpatch.enable(output="none")
    try:
        x = torch.ones(1024, device="emu")
        name = dist.group.WORLD.group_name
        compiled.ensure_installed()
        ops = torch.ops._c10d_functional
        for i in range(2 * steps):
            if rank == 1:
                emu.sleep(x, late_ms)  # its device is busy: its collective starts late
            if i < steps:
                result = funcol.all_reduce(x, "sum", dist.group.WORLD)
            else:
                result = ops.all_reduce.default(x, "sum", name)
            emu.sleep(x, 5)  # compute queued before the result is used
            y = result.wait() if i < steps else ops.wait_tensor.default(result)
            emu.sleep(y, 5)
            commpatch.step()
        timing = default().timing
        in_flight = timing.in_flight()
        with emu.capturing():  # a CUDA graph's capture: no event may be recorded, the row says so
            funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
            captured = timing.in_flight() - in_flight
        torch.accelerator.synchronize()
        df = commpatch.log()
        steps_table = per_step(df[df["step"] < 2 * steps])
    finally:
        commpatch.disable()
    cols = ("op", "device", "timing", "duration_us", "wait_us", "step")
    return {
        "rows": _rows(df, cols),
        "steps": steps_table[["step", "exposed_us", "overlap_unknown_us"]].to_dict("records"),
        "captured_in_flight": captured,
        "errors": emu.take_errors() + [f"{k}: {v}" for k, v in commpatch.internal_errors().items()],
    }


def fsdp2_device_stall(rank, world_size, late_ms=60, steps=4):
    """FSDP2 on the device (two units and the root), the group on a stream of its own
    (``pg.COMM_STREAM_ENV``, as NCCL's): rank 1 queues ``late_ms`` of device work before each step,
    so its first all-gather of the step starts late and rank 0's stream stalls where FSDP2's copy-out
    waits for it, while both hosts return at once. Returns the all-gather rows and the steps table."""
    import torch

    import commpatch
    from commpatch.analysis import per_step
    from tests import emulated_device as emu
    from tests.torch_compat import fully_shard as _fully_shard

    fully_shard = _fully_shard()
    commpatch.enable(output="none")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to("emu")
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        x = torch.randn(8, 64, device="emu")
        for _ in range(steps):
            if rank == 1:
                emu.sleep(x, late_ms)  # its device is busy: its all-gather starts late
            model(x).sum().backward()
            commpatch.step()
        torch.accelerator.synchronize()
        df = commpatch.log()
        steps_table = per_step(df[df["step"] < steps])
    finally:
        commpatch.disable()
    gathers = df[df["op"].isin(("all_gather_single", "all_gather_into_tensor"))]
    return {
        "rows": _rows(gathers, ("op", "device", "timing", "duration_us", "wait_us", "step")),
        "ops": sorted(set(df["op"].astype(str))),
        "steps": steps_table[["step", "exposed_us", "overlap_unknown_us"]].to_dict("records"),
        "errors": emu.take_errors() + [f"{k}: {v}" for k, v in commpatch.internal_errors().items()],
    }


def async_work_device_wait(rank, world_size, late_ms=60, steps=4):
    """A user's ``async_op=True`` all-reduce on the device and its ``Work.wait()``, the group on a
    stream of its own (``pg.COMM_STREAM_ENV``, as NCCL's): rank 1 queues ``late_ms`` of device work
    before each, so rank 0's stream stalls in the wait while its host returns at once. Then one
    work dropped unwaited and one waited twice. Returns the rows and the steps table."""
    import torch
    import torch.distributed as dist

    import commpatch
    from commpatch.analysis import per_step
    from commpatch.session import default
    from tests import emulated_device as emu

    commpatch.enable(output="none")
    try:
        x = torch.ones(1024, device="emu")
        for _ in range(steps):
            if rank == 1:
                emu.sleep(x, late_ms)  # its device is busy: its collective starts late
            work = dist.all_reduce(x, async_op=True)
            emu.sleep(x, 5)  # compute queued before the result is used
            work.wait()
            emu.sleep(x, 5)
            commpatch.step()
        dist.all_reduce(x, async_op=True)  # dropped unwaited: its entry goes with it
        noted_after_drop = len(default().timing.dev_waits)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        work.wait()  # a second wait passes at once: one stall noted
        torch.accelerator.synchronize()
        df = commpatch.log()
        steps_table = per_step(df[df["step"] < steps])
    finally:
        commpatch.disable()
    return {
        "rows": _rows(df, ("op", "async_op", "device", "timing", "duration_us", "wait_us", "step")),
        "steps": steps_table[["step", "exposed_us", "overlap_unknown_us"]].to_dict("records"),
        "noted_after_drop": noted_after_drop,
        "errors": emu.take_errors() + [f"{k}: {v}" for k, v in commpatch.internal_errors().items()],
    }
