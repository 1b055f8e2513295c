// etcd's own main: the server, built from go.etcd.io/etcd/server/v3 at the version
// pinned by the go.mod next to the copy that tests/etcd/build.py compiles.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
