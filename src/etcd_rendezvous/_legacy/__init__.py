"""The legacy ``etcd`` backend's internals: the rendezvous, its batched admission,
waiting, state and keep-alive threads."""
