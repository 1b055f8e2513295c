"""The dynamic rendezvous' internals and its ``etcd-v2`` backend: handler, state,
decisions, executor, node keys and the progress key."""
