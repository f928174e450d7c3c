// pause: the sandbox ("pause") container of every pod on the project's real node (infra/k8s/node.sh).
// It holds the pod's namespaces open, reaps the zombies of a shared PID namespace and exits on SIGINT/SIGTERM.
// No registry is reachable from the node, so the project builds its own instead of pulling registry.k8s.io/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
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
