// Command etcd is etcd's own main (go.etcd.io/etcd/v3/main.go), built from the
// etcd server module version that k8s.io/kubernetes itself pins.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
