"""Tests for EtcdStore against a real etcd (see the ``etcd_server`` fixture).

Waits are sequenced with threading events on spied connection methods, never with
sleeps; the spies only record calls and pass them on to the real connection. The
connections speak whichever API ``etcd_api=auto`` picks for the session's etcd (see the
``conn`` fixture); what needs v2 (python-etcd clients, PyTorch's store) is ``v2_only``.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous.api import Deadline, RendezvousConnectionError, RendezvousStateError, Store
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import DEFAULT_TIMEOUT, EtcdStore, cas_delay
from etcd_rendezvous.layout import store_value_key
from etcd_rendezvous.pytest_plugin import etcd_api_under_test
from support.faultproxy import FaultProxy
from support.history import forget_history
from support.threads import InThread
from support.transports import TRANSPORTS
from support.v3_gateway import b64

SHORT = timedelta(seconds=0.3)
# Generous: only reached if a test is about to fail.
LONG = timedelta(seconds=20)
#: Readers of one key in the many-readers test, each with a connection of its own.
READERS = 64


class Spy:
    """Records calls to a connection's ``get`` and ``watch`` and passes them on.

    ``watching`` is set whenever a watch is about to be sent, so a test can write the
    awaited key knowing the reader has reached its watch (the watch starts from an
    index, so a write that overtakes the request is still seen).
    """

    def __init__(self, conn: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.watching = threading.Event()
        self._lock = threading.Lock()
        for name in ("get", "watch"):
            monkeypatch.setattr(conn, name, self._wrap(name, getattr(conn, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append((name, args, kwargs))
            if name == "watch":
                self.watching.set()
            return method(*args, **kwargs)

        return wrapper

    def named(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        with self._lock:
            return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


@pytest.fixture
def store(conn: Transport, etcd_prefix: str) -> EtcdStore:
    return EtcdStore(conn, etcd_prefix, timeout=LONG)


StoreFactory = Callable[[str], EtcdStore]


@pytest.fixture
def own_store(etcd_server: EtcdServer) -> Iterator[StoreFactory]:
    """``own_store(prefix)``: a store over a connection of its own (as a separate worker
    has), over the API ``etcd_api=auto`` picks; closed with its connection afterwards."""
    stores: list[EtcdStore] = []

    def make(prefix: str) -> EtcdStore:
        connection = open_transport([(etcd_server.get_host(), etcd_server.get_port())])
        store = EtcdStore(connection, prefix, timeout=LONG, owns_connection=True)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


# -- construction ---------------------------------------------------------------------------


@pytest.mark.v2_only(reason="python-etcd's etcd.Client speaks v2 only")
def test_constructor_keeps_client_and_adds_slash(etcd_client: Any, etcd_prefix: str) -> None:
    store = EtcdStore(etcd_client, etcd_prefix)
    assert store.client is etcd_client
    assert isinstance(store.connection, EtcdConnection)
    assert store.prefix == etcd_prefix + "/"
    assert store.timeout == DEFAULT_TIMEOUT == timedelta(seconds=300)
    assert EtcdStore(etcd_client, etcd_prefix + "/").prefix == etcd_prefix + "/"
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    assert etcd_prefix in repr(store)


def test_constructor_takes_a_connection(conn: Transport, etcd_prefix: str) -> None:
    store = EtcdStore(conn, etcd_prefix, timeout=timedelta(seconds=3))
    assert store.client is conn
    assert store.connection is conn
    assert store.timeout == timedelta(seconds=3)
    assert store.prefix == etcd_prefix + "/"
    assert EtcdStore(conn, etcd_prefix + "/").prefix == etcd_prefix + "/"
    default = EtcdStore(conn, etcd_prefix)
    assert default.timeout == DEFAULT_TIMEOUT == timedelta(seconds=300)
    default.set_timeout(timedelta(seconds=7))
    assert default.timeout == timedelta(seconds=7)
    assert etcd_prefix in repr(default)


def test_constructor_rejects_bad_arguments(conn: Transport, etcd_prefix: str) -> None:
    with pytest.raises(TypeError, match="etcd_client"):
        EtcdStore(object(), etcd_prefix)
    with pytest.raises(TypeError, match="etcd_store_prefix"):
        EtcdStore(conn, 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        EtcdStore(conn, etcd_prefix, timeout=5)  # type: ignore[arg-type]


def test_satisfies_store_protocol(store: EtcdStore) -> None:
    as_protocol: Store = store
    as_protocol.set("k", b"v")
    assert as_protocol.get("k") == b"v"


def test_cas_delay_is_short() -> None:
    start = time.monotonic()
    cas_delay()
    assert time.monotonic() - start < 1.0


# -- set / get ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("plain", "value", b"value"),
        ("bytes", b"\x00\xff\x10binary", b"\x00\xff\x10binary"),
        (b"\xfe\xff-bytes-key", "v", b"v"),
        ("ключ ✓", "значение ✓ 🚀", "значение ✓ 🚀".encode()),
        ("empty", "", b""),
        # base64 "YT8/": an etcd key that ends in "/", which etcd stores without it.
        ("a??", "slash", b"slash"),
    ],
)
def test_set_get_roundtrip(
    store: EtcdStore, conn: Transport, key: str | bytes, value: str | bytes, expected: bytes
) -> None:
    store.set(key, value)
    assert store.get(key) == expected
    # Wire format: base64 key under the prefix, base64 value (as PyTorch writes them;
    # etcd v2 cleans a "//" in the path PyTorch sends, the store writes it clean).
    assert conn.get(store_value_key(store.prefix, b64(key))).value == b64(value)


def test_set_overwrites(store: EtcdStore) -> None:
    store.set("k", "one")
    store.set("k", b"two")
    assert store.get("k") == b"two"


def test_get_blocks_until_another_thread_sets(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(conn, monkeypatch)
    call = InThread(lambda: store.get("late"))
    assert spy.watching.wait(LONG.total_seconds())
    assert not call.done
    store.set("late", "finally")
    assert call.result(LONG.total_seconds()) == b"finally"
    # One read that found it missing, then one watch on that key: no polling.
    path = store.prefix + b64("late")
    assert len(spy.named("watch")) == 1
    (args, kwargs), *_ = spy.named("watch")
    assert args[0] == path
    assert not kwargs.get("recursive")
    assert [args[0] for args, _ in spy.named("get")] == [path]


def test_a_key_set_once_is_seen_by_every_waiting_reader(
    own_store: StoreFactory, etcd_prefix: str
) -> None:
    """As after a rendezvous: many ranks, each with a connection of its own, wait for
    the master address, which rank 0 writes once, while the ranks are still arriving
    (some read it missing and watch, some read it written). Every one of them gets it."""
    readers = [own_store(etcd_prefix) for _ in range(READERS)]
    writer = own_store(etcd_prefix)
    start = threading.Barrier(READERS + 1)

    def read(store: EtcdStore, delay: float) -> bytes:
        start.wait()
        time.sleep(delay)
        return store.get("MASTER_ADDR")

    # The readers arrive over 0.4 s; the key is written 0.2 s in.
    delays = [0.4 * i / READERS for i in range(READERS)]
    with ThreadPoolExecutor(READERS) as pool:
        futures = [pool.submit(read, store, delay) for store, delay in zip(readers, delays)]
        start.wait()
        time.sleep(0.2)
        writer.set("MASTER_ADDR", "10.0.0.1")
        values = [future.result(LONG.total_seconds()) for future in futures]
    assert values == [b"10.0.0.1"] * READERS


def test_get_waits_for_key_whose_encoding_ends_in_slash(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(conn, monkeypatch)
    call = InThread(lambda: store.get("a??"))
    assert spy.watching.wait(LONG.total_seconds())
    store.set("a??", "v")
    assert call.result(LONG.total_seconds()) == b"v"


def test_get_recovers_when_etcd_dropped_the_watched_history(
    store: EtcdStore, conn: Transport, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Push the index at which the key was seen missing out of etcd's history before
    # the watch is sent, and write the key meanwhile.
    real_watch = conn.watch
    watches: list[int] = []

    def watch(key: str, index: int, timeout: float, **kwargs: Any) -> Any:
        if not watches:
            forget_history(conn, etcd_server.client_url, store.prefix + "filler")
            store.set("k", "after-the-flood")
        watches.append(index)
        return real_watch(key, index, timeout, **kwargs)

    monkeypatch.setattr(conn, "watch", watch)
    spy = Spy(conn, monkeypatch)
    assert store.get("k") == b"after-the-flood"
    # One watch, answered "history cleared"; then a second read found the key.
    assert len(watches) == 1
    assert len(spy.named("get")) == 2


def test_a_wait_ended_by_its_callers_deadline_says_how_long_it_waited(store: EtcdStore) -> None:
    """A rendezvous bounds the store's wait for rank 0's address by what is left of its
    own timeout (:meth:`EtcdStore.with_deadline`): the message says the time waited, not
    the store's timeout."""
    store.set_timeout(timedelta(seconds=300))
    with pytest.raises(LookupError) as caught:
        store.with_deadline(Deadline(0.4)).get("never-set")
    message = str(caught.value)
    assert re.search(
        r"within 0\.[45] s \(its caller's deadline, earlier than the store's "
        r"timeout of 300 s\)\.$",
        message,
    ), message
    with pytest.raises(LookupError, match=r"set within 0\.[45] s \("):
        store.with_deadline(Deadline(0.4)).wait(["never-set"])
    # Its own timeout: said as it was set.
    store.set_timeout(SHORT)
    with pytest.raises(LookupError, match=r"'never-set'.* within 0\.3 s\.$"):
        store.multi_get(["never-set"])


def test_a_store_with_a_deadline_shares_the_store_and_ends_by_the_deadline(
    store: EtcdStore,
) -> None:
    view = store.with_deadline(Deadline(0.3))
    view.set("k", "v")
    assert store.get("k") == b"v"  # the same keys
    assert (view.prefix, view.timeout, view.connection) == (
        store.prefix,
        store.timeout,
        store.connection,
    )
    started = time.monotonic()
    with pytest.raises(LookupError):
        view.wait(["never-set"], LONG)  # an override of the timeout cannot outlast it
    assert time.monotonic() - started < 1.3
    view.close()
    assert store.get("k") == b"v"  # the view never closes the connection
    with pytest.raises(TypeError, match=r"deadline: expected an etcd_rendezvous\.api\.Deadline"):
        store.with_deadline(0.3)  # type: ignore[arg-type]


def test_get_timeout_names_the_key(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(conn, monkeypatch)
    store.set_timeout(SHORT)
    start = time.monotonic()
    with pytest.raises(LookupError, match="never-set"):
        store.get("never-set")
    elapsed = time.monotonic() - start
    assert SHORT.total_seconds() <= elapsed < SHORT.total_seconds() + 2.0
    # No busy loop: one read, and one watch that used up the time.
    assert len(spy.named("get")) == 1
    assert 1 <= len(spy.named("watch")) <= 2


def test_get_reads_only_the_key_not_the_directory(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.multi_set([f"key-{i}" for i in range(200)], [f"value-{i}" for i in range(200)])
    spy = Spy(conn, monkeypatch)
    assert store.get("key-123") == b"value-123"
    assert [(name, args) for name, args, _ in spy.calls] == [
        ("get", (store.prefix + b64("key-123"),))
    ]
    assert store.check(["key-1", "key-2"])
    assert store.multi_get(["key-3"]) == [b"value-3"]
    store.wait(["key-4"])
    dir_reads = [args for args, _ in spy.named("get") if args[0].rstrip("/") == store.prefix[:-1]]
    assert dir_reads == []
    assert len(spy.calls) == 5


def test_get_wrong_types(store: EtcdStore) -> None:
    with pytest.raises(TypeError, match="key"):
        store.get(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key"):
        store.set(None, "v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value"):
        store.set("k", 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key"):
        store.set("", "v")


# -- corrupt values ---------------------------------------------------------------------------


def test_corrupt_value_raises_state_error_and_is_left_alone(
    store: EtcdStore, conn: Transport
) -> None:
    etcd_key = store.prefix + b64("bad")
    conn.set(etcd_key, "not base64!")
    with pytest.raises(RendezvousStateError, match=r"'bad'.*not base64"):
        store.get("bad")
    with pytest.raises(RendezvousStateError, match="'bad'"):
        store.add("bad", 1)
    with pytest.raises(RendezvousStateError, match="'bad'"):
        store.append("bad", "x")
    with pytest.raises(RendezvousStateError, match="'bad'"):
        store.compare_set("bad", "x", "y")
    with pytest.raises(RendezvousStateError, match="'bad'"):
        store.multi_get(["bad"])
    assert conn.get(etcd_key).value == "not base64!"


@pytest.mark.v2_only(
    reason="v3 has no directories: a key below another does not stop it from being set"
)
def test_directory_where_a_key_belongs_is_a_state_error(store: EtcdStore, conn: Transport) -> None:
    conn.set(store.prefix + b64("dir") + "/child", "x")
    with pytest.raises(RendezvousStateError, match=r"'dir'.*directory"):
        store.get("dir")


# -- add --------------------------------------------------------------------------------------


def test_add_counts_from_zero_in_decimal(store: EtcdStore, conn: Transport) -> None:
    assert store.add("counter", 0) == 0
    assert store.add("counter", 5) == 5
    assert store.add("counter", -2) == 3
    assert store.get("counter") == b"3"
    raw = conn.get(store.prefix + b64("counter")).value or ""
    # The decimal text, base64-encoded, as PyTorch's store reads it (its non-strict
    # b64decode skips the write tag after "~" that resolves lost answers exactly).
    assert base64.b64decode(raw) == b"3"
    assert raw.split("~")[0] == b64("3")
    assert store.add("fresh", 7) == 7


def test_add_on_non_integer_raises_and_leaves_key(store: EtcdStore) -> None:
    store.set("text", "abc")
    with pytest.raises(ValueError, match=r"'text'.*not an integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"


def test_add_wrong_types(store: EtcdStore) -> None:
    with pytest.raises(TypeError, match="num"):
        store.add("k", "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num"):
        store.add("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key"):
        store.add(3, 1)  # type: ignore[arg-type]
    assert not store.check(["k"])


def test_add_is_atomic_across_threads(own_store: StoreFactory, etcd_prefix: str) -> None:
    threads, per_thread = 8, 25
    stores = [own_store(etcd_prefix) for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def work(store: EtcdStore) -> list[int]:
        barrier.wait()
        return [store.add("n", 1) for _ in range(per_thread)]

    with ThreadPoolExecutor(threads) as pool:
        results = [value for values in pool.map(work, stores) for value in values]
    total = threads * per_thread
    assert sorted(results) == list(range(1, total + 1))
    assert stores[0].get("n") == str(total).encode()


# -- wait / check -------------------------------------------------------------------------------


def test_check(store: EtcdStore) -> None:
    assert store.check([])
    assert not store.check(["a"])
    store.set("a", "1")
    assert store.check(["a"])
    assert not store.check(["a", "b"])
    store.set("b", "")
    assert store.check(["a", "b"])
    with pytest.raises(TypeError, match="keys"):
        store.check("a")


def test_wait_returns_at_once_for_present_keys(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.multi_set(["a", "b"], ["1", "2"])
    spy = Spy(conn, monkeypatch)
    # A zero timeout: any wait on etcd would time out. The keys are read, never watched.
    store.wait(["a", "b"], timedelta(seconds=0))
    assert spy.named("watch") == []
    assert sorted(args[0] for args, _ in spy.named("get")) == sorted(
        store.prefix + b64(key) for key in ("a", "b")
    )
    # No keys: nothing to ask etcd.
    spy.calls.clear()
    store.wait([], timedelta(seconds=0))
    assert spy.calls == []


def test_wait_for_many_keys_set_later(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [f"rank-{i}" for i in range(20)]
    store.set("rank-0", "already")
    store.set("unrelated", "x")
    spy = Spy(conn, monkeypatch)
    call = InThread(lambda: store.wait(keys))
    assert spy.watching.wait(LONG.total_seconds())
    writer = EtcdStore(conn, store.prefix, timeout=LONG)
    for key in reversed(keys[1:]):
        writer.set(key, "here")
    call.result(LONG.total_seconds())
    # Each key was read once (ours plus nothing else); the rest came from one
    # recursive watch on the store directory, resumed event after event.
    wanted = {store.prefix + b64(key) for key in keys}
    reads = [args[0] for args, _ in spy.named("get")]
    assert sorted(reads) == sorted(wanted)
    watches = spy.named("watch")
    assert all(kwargs.get("recursive") for _, kwargs in watches[:-1])
    assert len(watches) <= len(keys)


def test_wait_timeout_names_missing_keys(store: EtcdStore) -> None:
    store.set("present", "1")
    start = time.monotonic()
    with pytest.raises(LookupError, match="'absent-1', 'absent-2'") as info:
        store.wait(["present", "absent-1", "absent-2"], SHORT)
    assert "present'" not in str(info.value)
    assert time.monotonic() - start < SHORT.total_seconds() + 2.0
    with pytest.raises(TypeError, match="override_timeout"):
        store.wait(["present"], 1)  # type: ignore[arg-type]


# -- extended API ------------------------------------------------------------------------------


def test_compare_set_follows_c10d(store: EtcdStore) -> None:
    # Missing key, non-empty expectation: nothing written, the expectation returned.
    assert store.compare_set("k", "x", "y") == b"x"
    assert not store.check(["k"])
    # Missing key, empty expectation: created.
    assert store.compare_set("k", "", "y") == b"y"
    # Mismatch: unchanged, current value returned.
    assert store.compare_set("k", "z", "w") == b"y"
    assert store.get("k") == b"y"
    # Match: swapped.
    assert store.compare_set("k", b"y", b"w") == b"w"
    assert store.get("k") == b"w"
    # Present but empty value, empty expectation: swapped.
    store.set("e", "")
    assert store.compare_set("e", "", "q") == b"q"
    with pytest.raises(TypeError, match="desired_value"):
        store.compare_set("k", "w", 3)  # type: ignore[arg-type]


def test_compare_set_elects_one_winner(own_store: StoreFactory, etcd_prefix: str) -> None:
    contenders = 6
    stores = [own_store(etcd_prefix) for _ in range(contenders)]
    barrier = threading.Barrier(contenders)

    def contend(i: int) -> bytes:
        barrier.wait()
        return stores[i].compare_set("leader", "", f"node-{i}")

    with ThreadPoolExecutor(contenders) as pool:
        results = list(pool.map(contend, range(contenders)))
    assert len(set(results)) == 1
    assert stores[0].get("leader") == results[0]


def test_delete_key(store: EtcdStore) -> None:
    assert not store.delete_key("k")
    store.set("k", "v")
    assert store.delete_key("k")
    assert not store.check(["k"])
    assert store.add("k", 2) == 2


def test_num_keys(store: EtcdStore) -> None:
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("b", 1)
    store.set("a??", "nested-looking")  # encoded with a "/"
    store.set(b"\xfb\xff\xbf", "x")  # base64 "+/+/": a key inside an etcd directory
    assert store.num_keys() == 4
    store.delete_key("a")
    assert store.num_keys() == 3


def test_multi_set_multi_get(store: EtcdStore) -> None:
    store.multi_set(["a", b"b", "c"], ["1", b"2", ""])
    assert store.multi_get(["c", "a", "b", "a"]) == [b"", b"1", b"2", b"1"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["x", "y"], ["1"])
    with pytest.raises(TypeError, match="values"):
        store.multi_set(["x", "y"], ["1", 2])  # type: ignore[list-item]
    assert not store.check(["x"])  # nothing written when an argument is bad


def test_multi_get_waits_and_times_out(
    store: EtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.set("a", "1")
    spy = Spy(conn, monkeypatch)
    call = InThread(lambda: store.multi_get(["a", "b", "c"]))
    assert spy.watching.wait(LONG.total_seconds())
    store.multi_set(["c", "b"], ["3", "2"])
    assert call.result(LONG.total_seconds()) == [b"1", b"2", b"3"]
    store.set_timeout(SHORT)
    with pytest.raises(LookupError, match="'zz'"):
        store.multi_get(["a", "zz"])


def test_append(store: EtcdStore) -> None:
    store.append("s", "po")
    store.append("s", b"tato")
    assert store.get("s") == b"potato"
    store.set("empty", "")
    store.append("empty", "x")
    assert store.get("empty") == b"x"


def test_append_is_atomic_across_threads(own_store: StoreFactory, etcd_prefix: str) -> None:
    threads, per_thread = 4, 10
    stores = [own_store(etcd_prefix) for _ in range(threads)]

    def work(i: int) -> None:
        for j in range(per_thread):
            stores[i].append("log", f"<{i}.{j}>")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    log = stores[0].get("log").decode()
    tokens = log[1:-1].split("><")
    assert sorted(tokens) == sorted(f"{i}.{j}" for i in range(threads) for j in range(per_thread))


# -- giving up on lost races ----------------------------------------------------------------


def rival_before_each_swap(
    conn: Transport, key: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """Make another writer set ``key`` to ``value`` just before each compare-and-swap
    sent on ``conn``, so that every one of them loses for real. Returns its writes."""
    writes: list[Any] = []
    swap = conn.compare_and_swap

    def rival_first(*args: Any, **kwargs: Any) -> Any:
        writes.append(conn.set(key, value))
        return swap(*args, **kwargs)

    monkeypatch.setattr(conn, "compare_and_swap", rival_first)
    return writes


@pytest.mark.parametrize(
    "update",
    [
        pytest.param(lambda store: store.add("k", 1), id="add"),
        pytest.param(lambda store: store.compare_set("k", "7", "8"), id="compare_set"),
        pytest.param(lambda store: store.append("k", "x"), id="append"),
    ],
)
def test_read_modify_write_gives_up_at_the_store_timeout(
    store: EtcdStore,
    conn: Transport,
    monkeypatch: pytest.MonkeyPatch,
    update: Callable[[EtcdStore], Any],
) -> None:
    store.set("k", "7")
    rival = rival_before_each_swap(conn, f"{store.prefix}{b64('k')}", b64("7"), monkeypatch)
    store.set_timeout(SHORT)
    started = time.monotonic()
    with pytest.raises(LookupError, match=r"'k'.* within 0.3 s: other writers") as caught:
        update(store)
    elapsed = time.monotonic() - started
    assert type(caught.value) is LookupError  # the store timeout, as for get()
    assert SHORT.total_seconds() <= elapsed < LONG.total_seconds()
    assert len(rival) > 1  # it retried, then gave up
    assert store.get("k") == b"7"  # and wrote nothing


# -- interoperability with PyTorch (whose EtcdStore speaks v2 through python-etcd) ----------

torch_peer = pytest.mark.v2_only(reason="PyTorch's EtcdStore is a python-etcd (v2) client")


@pytest.fixture
def torch_store_class() -> Any:
    module = pytest.importorskip("torch.distributed.elastic.rendezvous.etcd_store")
    return module.EtcdStore


@pytest.mark.torch
@torch_peer
def test_torch_and_ours_read_each_others_keys(
    torch_store_class: Any, store: EtcdStore, etcd_server: EtcdServer
) -> None:
    theirs = torch_store_class(etcd_server.get_client(), store.prefix, timeout=LONG)
    store.set("from-ours", "ü-value")
    assert theirs.get("from-ours") == "ü-value".encode()
    theirs.set("from-torch", b"\x00\x01bytes")
    assert store.get("from-torch") == b"\x00\x01bytes"
    theirs.add("mixed", 5)
    assert store.add("mixed", 1) == 6
    assert theirs.add("mixed", 1) == 7
    assert theirs.check(["from-ours", "from-torch", "mixed"])
    assert store.check(["from-ours", "from-torch", "mixed"])


@pytest.mark.torch
@torch_peer
def test_torch_and_ours_add_concurrently(
    torch_store_class: Any, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    per_worker = 15
    workers: list[Any] = [
        torch_store_class(etcd_server.get_client(), etcd_prefix, timeout=LONG),
        torch_store_class(etcd_server.get_client(), etcd_prefix, timeout=LONG),
        EtcdStore(etcd_server.get_client(), etcd_prefix, timeout=LONG),
        EtcdStore(etcd_server.get_client(), etcd_prefix, timeout=LONG),
    ]
    barrier = threading.Barrier(len(workers))

    def work(worker: Any) -> list[int]:
        barrier.wait()
        return [worker.add("total", 1) for _ in range(per_worker)]

    with ThreadPoolExecutor(len(workers)) as pool:
        results = [value for values in pool.map(work, workers) for value in values]
    total = per_worker * len(workers)
    assert sorted(results) == list(range(1, total + 1))
    assert workers[0].get("total") == workers[2].get("total") == str(total).encode()


@pytest.mark.torch
@torch_peer
def test_ours_wakes_on_torch_write(
    torch_store_class: Any,
    store: EtcdStore,
    conn: Transport,
    etcd_server: EtcdServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    theirs = torch_store_class(etcd_server.get_client(), store.prefix, timeout=LONG)
    spy = Spy(conn, monkeypatch)
    call = InThread(lambda: store.get("MASTER_ADDR"))
    assert spy.watching.wait(LONG.total_seconds())
    theirs.set("MASTER_ADDR", "10.0.0.1")
    assert call.result(LONG.total_seconds()) == b"10.0.0.1"


# -- a write whose answer and history were lost -------------------------------------------


@pytest.fixture
def store_losing_a_swap(
    etcd_proxy: FaultProxy,
    conn: Transport,
    etcd_server: EtcdServer,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[EtcdStore]:
    """A store whose first compare-and-swap is applied, its answer lost and etcd's
    history of it forgotten before the re-sent copy is refused: no one can tell whether
    the lost copy applied."""
    with open_transport([etcd_proxy.endpoint], read_timeout=2) as via_proxy:
        store = EtcdStore(via_proxy, etcd_prefix)
        real_cas = via_proxy.compare_and_swap

        def cas(key: str, value: str, prev: Any, **kwargs: Any) -> Any:
            if etcd_proxy.dropped_responses == 0:
                etcd_proxy.drop_responses(
                    count=1,
                    close_client=True,
                    on_drop=lambda: forget_history(
                        conn, etcd_server.client_url, etcd_prefix + "/filler"
                    ),
                )
            return real_cas(key, value, prev, **kwargs)

        monkeypatch.setattr(via_proxy, "compare_and_swap", cas)
        yield store
    assert etcd_proxy.dropped_responses == 1
    assert not etcd_proxy.hook_errors


def test_compare_set_whose_outcome_etcd_cannot_tell_reads_the_result_back(
    store_losing_a_swap: EtcdStore,
) -> None:
    store = store_losing_a_swap
    store.set("k", "a")
    assert store.compare_set("k", "a", "b") == b"b"  # applied once, then read back
    assert store.get("k") == b"b"


def test_append_whose_outcome_etcd_cannot_tell_raises_without_writing_again(
    store_losing_a_swap: EtcdStore,
) -> None:
    store = store_losing_a_swap
    store.set("k", "a")
    with pytest.raises(RendezvousConnectionError, match="may or may not have been applied"):
        store.append("k", "b")
    assert store.get("k") == b"ab"  # the lost copy applied; not a second time


@pytest.mark.parametrize("prefix", ["/", ""])
def test_a_store_at_the_root_counts_and_waits(private_etcd_server: EtcdServer, prefix: str) -> None:
    """A store whose prefix is etcd's root keeps its keys right below it (``/<base64>``):
    its listing and its watches cover them, on both APIs (over v3, whose directories are
    prefixes, the root's keys start with ``/``, not ``//``). A server of its own: the
    root holds every key."""
    address = [(private_etcd_server.get_host(), private_etcd_server.get_port())]
    with TRANSPORTS[etcd_api_under_test()](address) as conn:
        assert EtcdStore(conn, prefix).num_keys() == 0
        _counts_and_waits(conn, prefix)
        assert EtcdStore(conn, prefix).num_keys() == 4


def _counts_and_waits(conn: Transport, prefix: str) -> None:
    """A store at ``prefix`` counts the two keys it sets, and a wait for two more ends
    when another store at ``prefix`` sets them."""
    store = EtcdStore(conn, prefix, timeout=timedelta(seconds=5))
    store.set("a", "1")
    store.set("b", "2")
    assert store.num_keys() == 2
    call = InThread(lambda: store.wait(["c", "d"]))
    writer = EtcdStore(conn, prefix, timeout=LONG)
    writer.set("c", "3")
    writer.set("d", "4")
    call.result(LONG.total_seconds())
    assert store.multi_get(["c", "d"]) == [b"3", b"4"]


@pytest.mark.parametrize("spelling", ["no-leading-slash", "double-slash"])
def test_a_store_prefix_spelled_otherwise_than_etcd_stores_it_counts_and_waits(
    conn: Transport, etcd_prefix: str, spelling: str
) -> None:
    """The store's keys are the prefix normalised as etcd stores it (one leading ``/``,
    no empty segment): listing and watching the directory must use that same form, or
    over v3 (whose keys are literal) ``num_keys`` finds nothing and a wait for several
    keys watches a range no key is written to, until its timeout."""
    prefix = etcd_prefix.lstrip("/") if spelling == "no-leading-slash" else etcd_prefix + "//s"
    _counts_and_waits(conn, prefix)
