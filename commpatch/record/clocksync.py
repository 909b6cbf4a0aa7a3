"""Each rank's wall-clock offset to rank 0, measured off the training thread (issue 25).

Rows carry ``start_ns`` on their own host's wall clock (CLOCK_REALTIME). Hosts differ by micro- to
milliseconds (NTP, PTP), or by seconds when one is not synchronised: the same order as, or far
more than, the arrival skews the cross-rank report ranks. So every rank measures the offset of
rank 0's wall clock to its own, NTP-style, through its own connection to the process group's store
(a TCPStore's: a client in Python, ``storeclient``, which ends quietly when the store's host goes
away; another store's: ``Store.clone()``; never the store object torch uses, never a collective,
nothing on the user's groups):

    rank i: t1 = now; set(q)       rank 0: wait(q); t2 = now; t3 = now; set(a, "t2 t3")
    rank i: get(a); t4 = now

Whatever the network and scheduling delays, t2 is after t1 and t3 before t4 in real time, so the
offset theta (rank 0's clock minus rank i's) lies in [t3 - t4, t2 - t1]: a bound, not a guess.
``PINGS`` exchanges per round, their intervals intersected; rounds at the first collective, then
after ``SCHEDULE_S`` (and every last entry of it), on a daemon thread per rank (rank 0's serves the
others one at a time, so a rank's exchange never queues behind another's; a rank whose thread has
not started yet is served in a later round). Each round's interval is noted in the rank's log
(``data.logfile`` record ``rank0_offset``: at, lo, hi in ns, and same: rank 0 runs on this
machine, by its boot id); the reader aligns ``start_ns`` with it (``data.clock``). Any failure (no
store, a peer without commpatch, the store gone at exit) ends the thread quietly: no record means
"not measured".

The keys of rank i's exchanges carry a random nonce of its own (``ready/i``'s value, read by rank 0
once), so they cannot be guessed or written ahead by a process that knows the protocol but not the
run. torch's store is not authenticated: a process that reads the store can still find them, and
answer for rank 0. What holds against that is in the reader (``data.clock``): a rank on rank 0's
machine is never shifted, and an offset that jumps between rounds is reported and widens the
rank's uncertainty, so no straggler is named within it.
"""

from __future__ import annotations

import re
import secrets
import threading
import time

from .storeclient import StoreClient

PREFIX = "commpatch/clock"
PINGS = 4  # exchanges per rank and round (intervals intersected)
SCHEDULE_S = (2.0, 10.0, 60.0, 300.0)  # waits between rounds; the last one repeats
WAIT_S = 10.0  # rank 0's wait for one request, a rank's for one answer
TURN_S = max(SCHEDULE_S) + 120.0  # a rank's wait for its next turn (rank 0 gone quiet after it: the end)
READY_S, READY_TRIES = 0.25, 8  # rank 0's next round while some rank's thread has not started
NONCE = re.compile(rb"[0-9a-f]{32}")  # a rank's nonce: 16 random bytes in hex


class ClockSync:
    """The measuring thread of one rank; ``note(at_ns, lo_ns, hi_ns, same_machine)`` receives each
    round's interval (rank i only; ``same_machine``: rank 0 answered with this machine's boot id).

    The thread blocks in the store only on keys that are coming (never a polling timeout: torch
    prints a warning on each); ``stop()`` sets the key it is blocked on, so it returns at once, and
    a rank that stops says so (``bye``) and answers its pending requests, so rank 0 never waits for it."""

    def __init__(self, store, rank: int, world_size: int, note, generation: str = "0", connect=None) -> None:
        # store: where stop() sets keys (a quick set from the caller's thread); connect(): the
        # thread's own connection to the same keys (default: connection(store))
        if connect is None:
            found = connection(store)
            if found is None:
                raise TypeError(f"no connection of its own to a {type(store).__name__}")
            store, connect = found
        self.store, self.rank, self.world_size, self.note = store, rank, world_size, note
        self.connect = connect
        self.prefix = f"{PREFIX}/{generation}"
        self.stop_event = threading.Event()
        self.waiting = ""  # the key the thread blocks on ('' : none)
        self.round = 0  # rank i: its exchanges so far (the keys' number)
        self.rounds = 0  # rounds completed (served on rank 0, measured elsewhere)
        self.error = ""  # why the thread ended early ('' : it did not)
        self.nonce = secrets.token_hex(16)  # rank i: in the keys of its exchanges (random per run)
        self.nonces: dict = {}  # rank 0: each rank's nonce, read from its ready key once
        self.gone: set = set()  # rank 0: ranks that stopped or never answered, not asked again
        self.late: set = set()  # rank 0: ranks whose thread had not started within WAIT_S of the first round
        self.thread = threading.Thread(target=self._run, name="commpatch-clock", daemon=True)
        self.thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """End the thread (the caller's thread sets the keys it or rank 0 may be waiting for, through
        the store object given; any failure there is ignored: the store may be gone); ``join_s``:
        wait that long for it to end (at exit: the process must not end with it inside the store)."""
        if self.stop_event.is_set():
            return
        self.stop_event.set()
        if not getattr(self.store, "connected", True):  # the thread's client never connected: nothing waits
            return
        keys = [self.waiting] if self.waiting else []
        if self.rank > 0:
            key = f"{self.prefix}/{self.rank}/{self.nonce}/{self.round}"
            keys = [f"{self.prefix}/bye/{self.rank}"] + [f"{key}/q{j}" for j in range(PINGS)] + keys
        for key in keys:
            try:
                self.store.set(key, b"")
            except Exception:  # noqa: BLE001 - the store is gone: so is anything waiting on it
                break
        if join_s > 0 and self.thread is not threading.current_thread():
            self.thread.join(timeout=join_s)

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stop_event.is_set()

    def _run(self) -> None:
        import datetime

        try:
            store = self.connect()  # its own connection: the user's store object is never waited on
            store.set_timeout(datetime.timedelta(seconds=TURN_S))
            if self.rank > 0:
                store.set(f"{self.prefix}/ready/{self.rank}", self.nonce.encode())
            served = [0] * self.world_size  # rank 0: exchanges done with each rank
            k = tries = 0
            while not self.stop_event.is_set():
                if self.rank == 0:
                    waiting = self._serve(store, served)
                else:
                    if not self._ask(store, self.round):
                        return
                    self.round += 1
                    waiting = False
                if self.stop_event.is_set():
                    return
                self.rounds += 1
                if waiting and tries < READY_TRIES:  # rank 0: soon again for ranks whose thread starts later
                    tries += 1
                    delay = READY_S
                else:
                    delay = SCHEDULE_S[min(k, len(SCHEDULE_S) - 1)]
                    k += 1
                if self.stop_event.wait(delay):
                    return
        except Exception as exc:  # noqa: BLE001 - measuring is optional: never an error in the job
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"

    def _wait(self, store, key: str, seconds: float) -> bool:
        """Block until ``key`` is set (raises after ``seconds``); False when stopped meanwhile."""
        import datetime

        self.waiting = key  # before the check: stop() sets it, or the check sees stop
        if self.stop_event.is_set():
            return False
        store.wait([key], datetime.timedelta(seconds=seconds))
        self.waiting = ""
        return not self.stop_event.is_set()

    def _serve(self, store, served: list) -> bool:
        """Rank 0: answer the ``PINGS`` requests of every other rank whose thread runs, one rank at
        a time (``served[i]``: its exchanges so far, the keys' number); True when some rank's thread
        has not started yet."""
        pending = False
        for i in range(1, self.world_size):
            if i in self.gone or store.check([f"{self.prefix}/bye/{i}"]):
                self.gone.add(i)
                continue
            ready = f"{self.prefix}/ready/{i}"
            if not store.check([ready]):
                if served[i] or i in self.late:  # waited for once already: a later round
                    pending = True
                    continue
                try:  # its thread starts at its first collective too: in a moment (a short job ends soon)
                    if not self._wait(store, ready, WAIT_S):
                        return False
                except Exception:  # noqa: BLE001 - not within WAIT_S: served in a later round
                    self.waiting = ""
                    self.late.add(i)
                    pending = True
                    continue
            if i not in self.nonces:
                nonce = store.get(ready)
                if not NONCE.fullmatch(nonce):  # not a rank's nonce (another writer): not asked
                    self.gone.add(i)
                    continue
                self.nonces[i] = nonce.decode()
            key = f"{self.prefix}/{i}/{self.nonces[i]}/{served[i]}"
            store.set(f"{key}/go", b"")
            for j in range(PINGS):
                try:
                    if not self._wait(store, f"{key}/q{j}", WAIT_S):
                        return False
                except Exception:  # noqa: BLE001 - that rank does not answer (gone): not asked again
                    self.waiting = ""
                    self.gone.add(i)
                    break
                t2 = time.time_ns()
                t3 = time.time_ns()
                store.set(f"{key}/a{j}", f"{t2} {t3} {BOOT_ID}".encode())
                store.delete_key(f"{key}/q{j}")
            served[i] += 1
        return pending

    def _ask(self, store, n: int) -> bool:
        """Rank i: wait for its ``n``-th turn, then measure; False when stopped."""
        key = f"{self.prefix}/{self.rank}/{self.nonce}/{n}"
        if not self._wait(store, f"{key}/go", TURN_S):
            return False
        store.delete_key(f"{key}/go")
        lo, hi, at, same = None, None, 0, False
        for j in range(PINGS):
            t1 = time.time_ns()
            store.set(f"{key}/q{j}", b"")
            if not self._wait(store, f"{key}/a{j}", WAIT_S):
                return False
            t4 = time.time_ns()
            answer = store.get(f"{key}/a{j}")
            store.delete_key(f"{key}/a{j}")
            t2, t3, *boot = answer.decode().split()
            t2, t3 = int(t2), int(t3)
            same = bool(BOOT_ID) and boot == [BOOT_ID]
            a, b = t3 - t4, t2 - t1
            if lo is None:
                lo, hi, at = a, b, t1
            elif max(lo, a) <= min(hi, b):  # intersect: the offset lies in both
                lo, hi = max(lo, a), min(hi, b)
            elif b - a < hi - lo:  # disjoint (a clock stepped meanwhile): the narrower
                lo, hi, at = a, b, t1
        if lo is not None:
            self.note(at, lo, hi, same)
        return True


def _boot_id() -> str:
    """This machine's boot id (Linux): processes that share it read one CLOCK_REALTIME (time
    namespaces offset only the monotonic and boot clocks); '' where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


BOOT_ID = _boot_id()


def connection(store):
    """(the store stop() sets keys in, a function giving the thread's own connection to the same
    keys): over a TCPStore (torchrun's, ``tcp://``, ``env://``, under any prefix stores), one
    ``storeclient.StoreClient`` for both (keys unprefixed in the TCPStore: torch's C++ client
    would print its connection failures into the job's stderr when the store's host goes away);
    else ``store.clone`` where torch has it (a ``FileStore`` on torch >= 2.5); None otherwise (not
    measured)."""
    import torch.distributed as dist

    base, hops = store, 0
    while not isinstance(base, dist.TCPStore) and hasattr(base, "underlying_store") and hops < 8:
        base, hops = base.underlying_store, hops + 1
    if isinstance(base, dist.TCPStore):
        client = StoreClient(base.host, base.port, timeout=TURN_S)
        return client, lambda: client
    if hasattr(store, "clone"):
        return store, store.clone
    return None


def unmeasured_stores() -> str | None:
    """The process-group stores whose clocks this torch cannot measure (None: none that torch's
    launchers make): a FileStore (``file://``) needs ``Store.clone()``, which torch < 2.5 lacks."""
    import torch
    import torch.distributed as dist

    if hasattr(dist.FileStore, "clone"):
        return None
    return f"a FileStore (file://): torch {torch.__version__} has no Store.clone(); the offsets are not measured"


def start(log, note=None) -> ClockSync | None:
    """A ClockSync for ``log``'s rank through the default process group's store, or None (one
    rank, no default group, no store to reach through a connection of its own)."""
    if log.world_size < 2 or log.rank < 0:
        return None
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without it: not measured
        return None
    try:
        found = connection(store)
    except Exception:  # noqa: BLE001 - a store of another kind: not measured
        found = None
    if found is None:
        return None
    import os

    # every rank starts one per process group it joins, in the same order: the same key prefix
    _STARTED[0] += 1
    generation = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{_STARTED[0]}"
    return ClockSync(found[0], log.rank, log.world_size, note or log.note_rank0_offset, generation, found[1])


_STARTED = [0]
