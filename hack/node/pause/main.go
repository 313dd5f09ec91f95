// Command pause is the sandbox (pause) container of the local real node: it holds a pod's
// namespaces, reaps orphaned children (it is PID 1 of pods that share their PID namespace) and
// exits 0 on SIGINT or SIGTERM. The same job as Kubernetes' build/pause/linux/pause.c, in Go so
// that it builds static with the toolchain hack/setup.sh already installs; there is no registry
// to pull registry.k8s.io/pause from.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (batchpilot local node)\n")
		return
	}
	if os.Getpid() != 1 {
		os.Stderr.WriteString("Warning: pause should be the first process\n")
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
