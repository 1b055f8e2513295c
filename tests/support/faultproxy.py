"""A loopback TCP proxy that injects real network faults between a client and etcd.

:class:`FaultProxy` listens on ``127.0.0.1`` and forwards every connection to a target
(usually an :class:`~etcd_rendezvous.etcd_server.EtcdServer`). Point the client under
test at :attr:`FaultProxy.endpoint` instead of the server, then switch modes while it
runs:

* :meth:`~FaultProxy.forward`: pass bytes both ways (the default).
* :meth:`~FaultProxy.drop_responses`: forward requests to the server but throw away its
  answers, so the server *applies* a write while the client never learns the outcome.
  The client socket is either held open (the client sees a read timeout) or closed (it
  sees the connection end without a response). With ``count`` only the next ``count``
  responses are dropped and the proxy then forwards again, which is how a test lets a
  client's re-send through after losing the first answer.
* :meth:`~FaultProxy.refuse`: close the listening port (connections are refused, as for
  a host that is down) and reset the connections already open.
* :meth:`~FaultProxy.reset`: accept connections and reset them at once; reset the open
  ones too.
* :meth:`~FaultProxy.delay`: forward, but hold every chunk of the server's answers for
  a while first (a slow network); :meth:`~FaultProxy.forward` ends it.

The proxy also parses the HTTP/1.1 requests it forwards (request line and
``Content-Length`` framing only), so a test can count exactly what reached the wire:
:attr:`~FaultProxy.requests`, :meth:`~FaultProxy.wait_for_requests`.

Example::

    with FaultProxy(server.get_host(), server.get_port()) as proxy:
        conn = EtcdConnection([proxy.endpoint], read_timeout=1)
        proxy.drop_responses(count=1, close_client=True)
        conn.set("/k", "v")  # applied; first answer lost, our client sends it again
        assert proxy.request_count == 2

Everything runs in named daemon threads: one accepting, two per connection (one per
direction). :meth:`~FaultProxy.stop` closes all sockets and joins them; it is
idempotent, as is :meth:`~FaultProxy.start`.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

__all__ = ["FaultProxy", "Mode", "ProxiedRequest"]

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_CHUNK = 65536
_JOIN_TIMEOUT = 5.0


class Mode(enum.Enum):
    """What the proxy does with traffic."""

    #: Pass bytes both ways.
    FORWARD = "forward"
    #: Forward requests; discard the server's responses.
    DROP_RESPONSES = "drop-responses"
    #: Listening port closed; connections are refused.
    REFUSE = "refuse"
    #: Connections are accepted and reset immediately.
    RESET = "reset"


@dataclass(frozen=True)
class ProxiedRequest:
    """One HTTP request that the proxy forwarded to the server."""

    method: str
    #: The request target, e.g. ``/v2/keys/foo?wait=true``.
    target: str
    #: Which client connection carried it (numbered from 1 in accept order).
    connection: int
    #: ``time.monotonic()`` when its head was complete.
    at: float

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.split("?", 1)[0]


class _RequestScanner:
    """Splits a client-to-server byte stream into HTTP/1.1 requests.

    Understands ``Content-Length`` bodies, which is all python-etcd sends. After a
    chunked body it stops recognising requests on that connection.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._body_left = 0
        self._lost = False

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        if self._lost:
            return []
        self._buffer += data
        found: list[tuple[str, str]] = []
        while True:
            if self._body_left:
                skipped = min(self._body_left, len(self._buffer))
                self._buffer = self._buffer[skipped:]
                self._body_left -= skipped
                if self._body_left:
                    return found
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return found
            head = self._buffer[:end].decode("latin-1")
            self._buffer = self._buffer[end + 4 :]
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            found.append((parts[0], parts[1] if len(parts) > 1 else ""))
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    self._body_left = int(value.strip() or 0)
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self._lost = True
                    return found


class _Connection:
    """One proxied client connection and its upstream socket."""

    def __init__(self, number: int, client: socket.socket, upstream: socket.socket) -> None:
        self.number = number
        self.client = client
        self.upstream = upstream
        #: Set once a response was dropped: the HTTP stream to the client is broken,
        #: so nothing more may reach it.
        self.poisoned = False
        #: Whether the client socket is held open after a dropped response.
        self.hold = False
        self.threads: list[threading.Thread] = []
        #: Pumps still running; the last one to end closes the connection.
        self.pumps_alive = 2
        self._closed = False
        self._lock = threading.Lock()

    def close(self, *, reset: bool = False) -> None:
        """Close both sockets (with a TCP RST to the client if ``reset``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if reset:
            _set_linger_zero(self.client)
            # SHUT_RD wakes our pump blocked in recv() without sending a FIN, so that
            # close() sends the RST as the first thing the client hears.
            _shutdown(self.client, socket.SHUT_RD)
        else:
            _shutdown(self.client)
        self.client.close()
        _shutdown(self.upstream)
        self.upstream.close()

    def close_client(self) -> None:
        """End the client side (FIN) while the server side keeps draining."""
        _shutdown(self.client)


class FaultProxy:
    """A thread-based TCP proxy on loopback whose behaviour tests switch at run time.

    Args:
        target_host: host to forward to.
        target_port: port to forward to.
        listen_port: port to listen on (0 picks a free one; it is kept across
            :meth:`refuse` and :meth:`forward`).
        connect_timeout: seconds to wait for the target when a client connects; if it
            cannot be reached the client connection is reset.
        name: used in thread names and logs.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_port: int = 0,
        connect_timeout: float = 5.0,
        name: str = "faultproxy",
    ) -> None:
        self._target = (target_host, target_port)
        self._port = listen_port
        self._connect_timeout = connect_timeout
        self._name = name
        self._cond = threading.Condition()
        self._mode = Mode.FORWARD
        #: Seconds each chunk of a response is held before it is passed on.
        self._delay = 0.0
        self._drops_left: int | None = None
        self._close_on_drop = False
        self._on_drop: Callable[[], object] | None = None
        self._hook_errors: list[BaseException] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._connections: dict[int, _Connection] = {}
        self._numbers = itertools.count(1)
        self._requests: list[ProxiedRequest] = []
        self._dropped = 0
        self._accepted = 0
        self._started = False
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Start listening and forwarding. Idempotent; a stopped proxy cannot restart."""
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"{self._name}: a stopped proxy cannot be started again")
            if self._started:
                return self
            self._started = True
            self._open_listener()
        logger.debug("%s: %s -> %s:%d", self._name, self.endpoint, *self._target)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and join all threads. Idempotent."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            acceptor = self._acceptor
            self._close_listener()
            connections = list(self._connections.values())
            self._connections.clear()
            self._cond.notify_all()
        for conn in connections:
            conn.close(reset=True)
        threads = [t for c in connections for t in c.threads]
        if acceptor is not None:
            threads.append(acceptor)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- where it is ---------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address the proxy listens on (always ``127.0.0.1``)."""
        return _HOST

    @property
    def port(self) -> int:
        """The listening port (valid after :meth:`start`)."""
        return self._port

    @property
    def endpoint(self) -> tuple[str, int]:
        """``(host, port)`` of the proxy, as :class:`EtcdConnection` takes endpoints."""
        return (_HOST, self._port)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{_HOST}:{self._port}"

    # -- faults --------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        """The current mode."""
        return self._mode

    def forward(self) -> None:
        """Pass traffic both ways; re-open the listening port if it was closed.

        Connections whose response was already dropped stay broken.
        """
        with self._cond:
            self._require_running()
            self._mode = Mode.FORWARD
            self._delay = 0.0
            self._drops_left = None
            if self._listener is None:
                self._open_listener()

    def delay(self, seconds: float) -> None:
        """Forward both ways, holding each chunk of the server's answers ``seconds``
        before passing it on (``0``: no delay), until the mode changes."""
        if seconds < 0:
            raise ValueError(f"seconds: must not be negative, got {seconds!r}")
        self.forward()
        with self._cond:
            self._delay = seconds

    def drop_responses(
        self,
        count: int | None = None,
        *,
        close_client: bool = False,
        on_drop: Callable[[], object] | None = None,
    ) -> None:
        """Forward requests but discard what the server answers.

        The connection that lost a response never carries anything to the client again
        (its HTTP stream is out of step). Its client socket is held open, so the client
        waits for its read timeout, or with ``close_client`` closed at once, so the
        client sees the connection end without a response.

        Args:
            count: drop the next ``count`` responses, then forward again; ``None``
                drops every response until the mode is changed.
            close_client: end the client connection when its response is dropped.
            on_drop: called (in a proxy thread) after a response was dropped and before
                the client can notice: the moment for "another writer" to act while the
                client is in the dark. Its exceptions are kept in :attr:`hook_errors`.
        """
        if count is not None and count < 1:
            raise ValueError(f"count: must be at least 1, got {count!r}")
        with self._cond:
            self._require_running()
            if self._listener is None:
                self._open_listener()
            self._mode = Mode.DROP_RESPONSES
            self._drops_left = count
            self._close_on_drop = close_client
            self._on_drop = on_drop

    def refuse(self) -> None:
        """Close the listening port and reset open connections: the host looks down."""
        with self._cond:
            self._require_running()
            self._mode = Mode.REFUSE
            self._close_listener()
        self.reset_connections()

    def reset(self) -> None:
        """Reset open connections, and every new one as soon as it is accepted."""
        with self._cond:
            self._require_running()
            self._mode = Mode.RESET
            if self._listener is None:
                self._open_listener()
        self.reset_connections()

    def reset_connections(self) -> int:
        """Reset (TCP RST) the connections open now; returns how many there were."""
        with self._cond:
            connections = list(self._connections.values())
        for conn in connections:
            conn.close(reset=True)
        return len(connections)

    # -- what happened -------------------------------------------------------------------

    @property
    def requests(self) -> list[ProxiedRequest]:
        """The requests forwarded so far, in order."""
        with self._cond:
            return list(self._requests)

    @property
    def request_count(self) -> int:
        """How many requests were forwarded so far."""
        with self._cond:
            return len(self._requests)

    @property
    def dropped_responses(self) -> int:
        """How many responses were dropped so far."""
        with self._cond:
            return self._dropped

    @property
    def hook_errors(self) -> list[BaseException]:
        """Exceptions raised by ``on_drop`` hooks (tests should assert it is empty)."""
        with self._cond:
            return list(self._hook_errors)

    @property
    def accepted_connections(self) -> int:
        """How many client connections were accepted so far."""
        with self._cond:
            return self._accepted

    def clear_stats(self) -> None:
        """Forget the requests, drops and connections counted so far."""
        with self._cond:
            self._requests.clear()
            self._dropped = 0
            self._accepted = 0

    def wait_for_requests(
        self, count: int, timeout: float, where: Callable[[ProxiedRequest], bool] | None = None
    ) -> list[ProxiedRequest]:
        """Wait until ``count`` requests (matching ``where``) were forwarded; return them.

        Raises:
            TimeoutError: if that does not happen within ``timeout`` seconds.
        """

        def matching() -> list[ProxiedRequest]:
            return [r for r in self._requests if where is None or where(r)]

        with self._cond:
            if not self._cond.wait_for(lambda: len(matching()) >= count, timeout):
                raise TimeoutError(
                    f"{self._name}: {len(matching())} of {count} requests after {timeout}s"
                )
            return matching()

    def wait_for_dropped(self, count: int, timeout: float) -> None:
        """Wait until ``count`` responses were dropped.

        Raises:
            TimeoutError: if that does not happen within ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._dropped >= count, timeout):
                raise TimeoutError(
                    f"{self._name}: {self._dropped} of {count} dropped responses after {timeout}s"
                )

    def __repr__(self) -> str:
        target = f"{self._target[0]}:{self._target[1]}"
        return f"<FaultProxy {self._name} {self.url} -> {target} {self._mode.value}>"

    # -- internals -----------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._started or self._stopped:
            raise RuntimeError(f"{self._name}: the proxy is not running")

    def _open_listener(self) -> None:
        """Bind (again) and start an accept thread. Caller holds ``_cond``."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((_HOST, self._port))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        self._port = listener.getsockname()[1]
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop,
            args=(listener,),
            name=f"{self._name}-accept-{self._port}",
            daemon=True,
        )
        self._acceptor.start()

    def _close_listener(self) -> None:
        """Close the listening socket, which ends its accept thread. Caller holds ``_cond``."""
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes a thread blocked in accept(); close() alone does not.
            _shutdown(listener)
            listener.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            with self._cond:
                mode = self._mode
                self._accepted += 1
                if self._listener is not listener or self._stopped:
                    mode = Mode.REFUSE
            if mode in (Mode.RESET, Mode.REFUSE):
                _set_linger_zero(client)
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=self._connect_timeout)
            except OSError as exc:
                logger.info("%s: cannot reach %s: %s", self._name, self._target, exc)
                _set_linger_zero(client)
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve(client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        conn = _Connection(next(self._numbers), client, upstream)
        conn.threads = [
            threading.Thread(
                target=self._pump_requests,
                args=(conn,),
                name=f"{self._name}-{conn.number}-requests",
                daemon=True,
            ),
            threading.Thread(
                target=self._pump_responses,
                args=(conn,),
                name=f"{self._name}-{conn.number}-responses",
                daemon=True,
            ),
        ]
        with self._cond:
            # The mode may have changed while we connected to the target.
            if self._stopped or self._mode in (Mode.REFUSE, Mode.RESET):
                conn.close(reset=True)
                return
            self._connections[conn.number] = conn
        for thread in conn.threads:
            thread.start()

    def _pump_requests(self, conn: _Connection) -> None:
        """Client to server: always forwarded (so writes reach etcd), and counted."""
        scanner = _RequestScanner()
        try:
            while True:
                data = conn.client.recv(_CHUNK)
                if not data:
                    break
                found = scanner.feed(data)
                if found:
                    # Recorded before forwarding, so a request is counted before the
                    # client can possibly have its answer.
                    now = time.monotonic()
                    with self._cond:
                        self._requests.extend(
                            ProxiedRequest(method, target, conn.number, now)
                            for method, target in found
                        )
                        self._cond.notify_all()
                conn.upstream.sendall(data)
        except OSError:
            pass
        finally:
            # The client is done sending (or gone): pass the half-close on.
            _shutdown(conn.upstream, socket.SHUT_WR)
            self._maybe_finish(conn)

    def _pump_responses(self, conn: _Connection) -> None:
        """Server to client: forwarded, or dropped in :attr:`Mode.DROP_RESPONSES`."""
        try:
            while True:
                data = conn.upstream.recv(_CHUNK)
                if not data:
                    break
                if self._should_drop(conn):
                    continue
                delay = self._delay
                if delay:
                    time.sleep(delay)
                conn.client.sendall(data)
        except OSError:
            pass
        finally:
            if conn.hold:
                # Hold the client socket open: the client must see a read timeout, not
                # an end of stream. It closes its side when it gives up.
                self._wait_for_client_close(conn)
            conn.close()
            self._maybe_finish(conn)

    def _should_drop(self, conn: _Connection) -> bool:
        """Whether data from the server on ``conn`` must be discarded (and if this is
        the first such data, break the connection and run the ``on_drop`` hook)."""
        with self._cond:
            if conn.poisoned:
                return True
            if self._mode is not Mode.DROP_RESPONSES:
                return False
            conn.poisoned = True
            conn.hold = not self._close_on_drop
            hook = self._on_drop
            if self._drops_left is not None:
                self._drops_left -= 1
                if self._drops_left <= 0:
                    self._mode = Mode.FORWARD
                    self._drops_left = None
        logger.debug("%s: dropped a response on connection %d", self._name, conn.number)
        if hook is not None:
            try:
                hook()
            except Exception as exc:
                logger.exception("%s: on_drop hook failed", self._name)
                with self._cond:
                    self._hook_errors.append(exc)
        with self._cond:
            # Counted only now, so whoever waits for the drop also sees the hook's effects.
            self._dropped += 1
            self._cond.notify_all()
        if not conn.hold:
            conn.close_client()
        return True

    def _wait_for_client_close(self, conn: _Connection) -> None:
        """Block until the requests pump of ``conn`` has ended (client closed or reset)."""
        requests_pump = conn.threads[0]
        if requests_pump is not threading.current_thread():
            requests_pump.join()

    def _maybe_finish(self, conn: _Connection) -> None:
        """Called by each pump as it ends; the last one closes and forgets ``conn``."""
        with self._cond:
            conn.pumps_alive -= 1
            if conn.pumps_alive > 0:
                return
            self._connections.pop(conn.number, None)
        conn.close()


def _set_linger_zero(sock: socket.socket) -> None:
    """Make ``close()`` send a TCP RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)
