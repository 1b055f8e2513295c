"""The ``etcd-v2`` rendezvous backend, ported from PyTorch Elastic.

:class:`EtcdRendezvousBackend` holds the state of a
:class:`~etcd_rendezvous.dynamic_rendezvous.DynamicRendezvousHandler` in one etcd key,
``/torch/elastic/rendezvous/<run_id>``, as PyTorch 2.13's backend of the same name does
(the base64 of the state bytes, the key's ``modifiedIndex`` as the fencing token, a
two-hour TTL), so PyTorch's workers and ours share one state. It also keeps our nodes'
keys, and lets the handler wait for a change with a watch instead of polling. How, and
what differs from PyTorch's backend: :doc:`/how-it-works`, section "The dynamic
rendezvous".
"""

from __future__ import annotations

from ._dynamic.etcd_backend import EtcdRendezvousBackend, create_backend

__all__ = ["EtcdRendezvousBackend", "create_backend"]
