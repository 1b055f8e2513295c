"""Tests against real etcd servers (started by the fixtures in ``tests/conftest.py``)."""
