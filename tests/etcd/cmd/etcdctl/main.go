// etcdctl's own main, built from go.etcd.io/etcd/etcdctl/v3 at the version pinned by
// the go.mod next to the copy that tests/etcd/build.py compiles.
package main

import "go.etcd.io/etcd/etcdctl/v3/ctlv3"

func main() { ctlv3.MustStart() }
