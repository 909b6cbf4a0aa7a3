"""A client of torch's TCPStore in Python, for the clock exchange's own connection (``clocksync``).

torch's C++ client prints its connection failures to the process's stderr (``recvValueWithTimeout
failed ... Did the remote server shutdown or crash?``, three blocks with stack frames) when the
store's host goes away while a thread waits in it: a job whose rank 0 died would show them on every
other rank, from a connection that only measures clocks. This client speaks the same wire protocol
(``torch/csrc/distributed/c10d/TCPStoreBackend.hpp``, unchanged from torch 2.4 to 2.15 for the
queries used: a validation message, then SET, GET, CHECK, WAIT, DELETE_KEY with 64-bit lengths)
and raises ``ConnectionError`` / ``TimeoutError`` quietly instead; the clock thread ends on them.

Keys are those of torch's client of the TCPStore itself (no process group's prefix: the exchange's
keys carry their own). A wait that
times out closes the connection (a reply to it would otherwise come later, out of turn); the next
query connects again. Sends hold a lock, so that ``set`` from another thread (``ClockSync.stop``)
can release a wait this connection's thread is blocked in.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading

VALIDATE, SET, GET, CHECK, WAIT, DELETE_KEY = 0, 1, 3, 5, 6, 8  # QueryType
MAGIC = 0x3C85F7CE  # validationMagicNumber
READY = 0  # CheckResponseType::READY
STOP_WAITING = 0  # WaitResponseType::STOP_WAITING
KEY_PREFIX = "/"  # TCPStore::keyPrefix_: torch's client puts it before every key
MAX_VALUE = 1 << 20  # the exchange's values are tens of bytes: a larger length is not a TCPStore reply


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _string(data: bytes) -> bytes:
    return struct.pack("=Q", len(data)) + data


def _key(key: str) -> bytes:
    return _string((KEY_PREFIX + key).encode())


def _keys(keys) -> bytes:
    return struct.pack("=Q", len(keys)) + b"".join(map(_key, keys))


class StoreClient:
    """One connection to the TCPStore at ``host:port`` (made at the first query), with the methods
    of torch's ``Store`` that the clock exchange uses."""

    def __init__(self, host: str, port: int, timeout=300.0) -> None:
        self.host, self.port = host, int(port)
        self.timeout = _seconds(timeout)
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def set_timeout(self, timeout) -> None:
        self.timeout = _seconds(timeout)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _connected(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=min(self.timeout, 30.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(struct.pack("=BI", VALIDATE, MAGIC))
            self.sock = sock
        return self.sock

    def _send(self, data: bytes) -> socket.socket:
        with self.lock:
            sock = self._connected()
            sock.sendall(data)
            return sock

    def _recv(self, sock: socket.socket, n: int, timeout: float) -> bytes:
        sock.settimeout(timeout)
        out = b""
        try:
            while len(out) < n:
                chunk = sock.recv(n - len(out))
                if not chunk:
                    raise ConnectionError(f"the store at {self.host}:{self.port} closed the connection")
                out += chunk
        except socket.timeout:
            self.close()  # its reply would come later, out of turn
            raise TimeoutError(f"no reply from the store at {self.host}:{self.port} within {timeout:g} s") from None
        except OSError:
            self.close()
            raise
        return out

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._send(bytes([SET]) + _key(key) + _string(value))

    def check(self, keys) -> bool:
        sock = self._send(bytes([CHECK]) + _keys(keys))
        return self._recv(sock, 1, self.timeout)[0] == READY

    def wait(self, keys, timeout=None) -> None:
        seconds = self.timeout if timeout is None else _seconds(timeout)
        sock = self._send(bytes([WAIT]) + _keys(keys))
        reply = self._recv(sock, 1, seconds)[0]
        if reply != STOP_WAITING:
            self.close()
            raise ConnectionError(f"the store at {self.host}:{self.port} answered a wait with {reply}")

    def get(self, key: str) -> bytes:
        self.wait([key])  # as torch's client: GET of a missing key is an error on the server
        sock = self._send(bytes([GET]) + _key(key))
        (size,) = struct.unpack("=Q", self._recv(sock, 8, self.timeout))
        if size > MAX_VALUE:
            self.close()
            raise ConnectionError(f"the store at {self.host}:{self.port} sent a {size}-byte value")
        return self._recv(sock, size, self.timeout) if size else b""

    def delete_key(self, key: str) -> bool:
        sock = self._send(bytes([DELETE_KEY]) + _key(key))
        (deleted,) = struct.unpack("=q", self._recv(sock, 8, self.timeout))
        return deleted > 0
