"""The legacy ``etcd`` backend's internals: admission, waiting, state and keep-alives."""
