"""The throw-away etcd process that ``EtcdServer`` and ``EtcdCluster`` run."""
