"""The etcd transport: one interface, its v2 and v3 implementations, the failover loop,
retry and options."""
