"""TLS failures that are an endpoint going away, not a misconfiguration: retried."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.etcd_server import EtcdServer


class Balancer:
    """A TCP load balancer in front of one backend: it relays connections, or, while its
    backend is down (:meth:`backend_down`), accepts them, reads what the client sends
    first (a TLS ClientHello) and closes them, as HAProxy or a cloud load balancer does.
    """

    def __init__(self, backend: tuple[str, int]) -> None:
        self._backend = backend
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.endpoint = self._listener.getsockname()
        self._lock = threading.Condition()
        self._down = False
        self._open: list[socket.socket] = []
        #: Connections accepted and closed while the backend was down.
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def backend_down(self) -> None:
        with self._lock:
            self._down = True
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open.clear()

    def backend_up(self) -> None:
        with self._lock:
            self._down = False

    def wait_dropped(self, count: int, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.dropped >= count, timeout)

    def close(self) -> None:
        self._listener.close()
        self.backend_down()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                with client:
                    client.settimeout(1)
                    with contextlib.suppress(OSError):
                        client.recv(65536)
                        client.shutdown(socket.SHUT_WR)
                with self._lock:
                    self.dropped += 1
                    self._lock.notify_all()
                continue
            upstream = socket.create_connection(self._backend)
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def balancer(tls_etcd_server: EtcdServer) -> Iterator[Balancer]:
    lb = Balancer((tls_etcd_server.get_host(), tls_etcd_server.get_port()))
    yield lb
    lb.close()


def test_a_tls_load_balancer_whose_backend_restarts_is_ridden_out(
    connect: Callable[..., Transport],
    balancer: Balancer,
    tls_certs: dict[str, str],
    key: str,
) -> None:
    # A job's connection goes through a TCP load balancer; its etcd restarts (a rolling
    # upgrade): for a moment the balancer accepts connections and closes them in the
    # TLS handshake. The operation under way is retried until etcd is back.
    tls = {
        "protocol": "https",
        "cacert": tls_certs["ca.crt"],
        "cert": tls_certs["node.crt"],
        "key": tls_certs["node.key"],
    }
    conn = connect(balancer.endpoint, read_timeout=20, **tls)
    conn.set(key, "before")
    balancer.backend_down()

    def restart() -> None:
        if balancer.wait_dropped(2, timeout=15):
            balancer.backend_up()

    threading.Thread(target=restart, daemon=True).start()
    written = conn.set(key, "after", deadline=Deadline(15))
    assert balancer.dropped >= 2
    node = conn.get(key)
    assert (node.value, node.modified_index) == ("after", written.modified_index)
