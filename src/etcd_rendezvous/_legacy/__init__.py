"""The legacy ``etcd`` backend's internals: the rendezvous, its batched join (decisions
and their execution), the state feed, waiting, state and keep-alive threads."""
