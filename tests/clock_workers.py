"""Workers of tests/test_clock.py (spawned by tests/multiproc.py run_ranks)."""


def exchange_job(rank: int, n: int, out: str, seconds: float = 3.0):
    """all_reduce calls for about ``seconds`` with the binary log under ``out`` (the clock exchange
    runs beside them through the process group's store); results checked here."""
    import os
    import time

    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    calls = int(seconds / 0.005)  # the same number on every rank
    for _ in range(calls):
        x = torch.full((256,), float(rank))
        dist.all_reduce(x)
        assert float(x[0]) == sum(range(n))
        time.sleep(0.005)
    dist.barrier()
    commpatch.disable()
    return calls


def tcp_exchange(rank: int, n: int, port: int, seconds: float = 2.5):
    """The exchange alone over a TCPStore whose server is rank 0's (as ``init_method='tcp://'`` or
    torchrun's store): the intervals each rank noted."""
    import time

    import torch.distributed as dist

    from commpatch.record.clocksync import ClockSync

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, wait_for_workers=True)
    noted = []
    sync = ClockSync(store, rank, n, lambda *interval: noted.append(interval), generation="test")
    time.sleep(seconds)
    sync.stop()
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(n)])  # rank 0's server lives until every rank is done
    return noted, sync.rounds, sync.error


def tcp_job(rank: int, n: int, out: str, port: int, seconds: float = 4.0, boot_id: str = ""):
    """``exchange_job`` over a process group whose store is a TCPStore on ``port`` held by rank 0
    (the FileStore group of run_ranks replaced: a store other processes can reach, as torchrun's);
    ``boot_id``: rank 1's boot id taken as this ('': its own), as on another machine. Returns the
    calls of each rank."""
    import torch.distributed as dist

    from commpatch.record import clocksync

    if boot_id and rank == 1:
        clocksync.BOOT_ID = boot_id
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    return exchange_job(rank, n, out, seconds)


def rewrite_answers(port: int, rank: int, shift_ns: int, until: float) -> list:
    """A process with access to the job's TCPStore (torch's is not authenticated) answers for rank
    0 after ``rank``'s first round: it finds the rank's keys (its nonce, in its ready key, found by
    listing the keys), says the rank left (rank 0 then no longer serves it), and serves its next
    rounds itself, rank 0's clock ``shift_ns`` ahead, with another machine's boot id. Runs until
    the Unix time ``until`` or the store goes; returns the answers it wrote."""
    import datetime
    import socket
    import time

    import torch.distributed as dist

    while time.time() < until:  # until the store listens (torch's client retries only seconds apart)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.02)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    ready = None
    while ready is None and time.time() < until:
        if hasattr(store, "list_keys"):
            ready = next(
                (k for k in store.list_keys() if "commpatch/clock/" in k and k.endswith(f"/ready/{rank}")), None
            )
        else:  # torch < 2.5 lists no keys: the name of the first group's exchange (restart 0, group 1)
            guess = f"commpatch/clock/0-1/ready/{rank}"
            ready = guess if store.check([guess]) else None
        time.sleep(0.01)
    nonce = store.get(ready).decode()
    prefix = ready[: -len(f"ready/{rank}")]
    time.sleep(0.5)  # its first round, served by rank 0
    store.set(f"{prefix}bye/{rank}", b"")
    written: list = []
    try:
        for n in range(1, 100):
            key = f"{prefix}{rank}/{nonce}/{n}" if nonce else f"{prefix}{rank}/{n}"  # (before issue 33: none)
            store.set(f"{key}/go", b"")
            for j in range(4):
                store.wait([f"{key}/q{j}"], datetime.timedelta(seconds=max(until - time.time(), 0.1)))
                t = time.time_ns() + shift_ns
                store.set(f"{key}/a{j}", f"{t} {t} forged-boot-id".encode())
                written.append(f"{key}/a{j}")
    except Exception:  # noqa: BLE001 - the job ended: its store is gone
        pass
    return written


def warm() -> bool:
    """Import torch.distributed in a pool's process (the attacker then starts at once)."""
    import torch.distributed  # noqa: F401

    return True
