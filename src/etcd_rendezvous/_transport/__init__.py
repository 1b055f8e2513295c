"""The etcd transport: one interface, its v2 and v3 implementations, retry, options."""
