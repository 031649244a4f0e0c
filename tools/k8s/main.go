// Command batchknee-k8s is a multicall binary: kube-apiserver, kube-controller-manager,
// kube-scheduler, etcd and kubectl, each exactly as upstream wires its own main().
//
// It dispatches on the basename of argv[0] (a symlink named kube-apiserver runs the apiserver) or,
// when invoked as batchknee-k8s, on its first argument (batchknee-k8s etcd --name x ...).
// Run one component per process: the apiserver's signal handling and logging are process-global.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // CronJob time zones, as upstream's kube-apiserver and kube-controller-manager

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"

	_ "k8s.io/client-go/plugin/pkg/client/auth" // kubectl's auth plugins
)

var components = map[string]func() int{
	"kube-apiserver": func() int {
		return cli.Run(apiserver.NewAPIServerCommand())
	},
	"kube-controller-manager": func() int {
		return cli.Run(controllermanager.NewControllerManagerCommand())
	},
	"kube-scheduler": func() int {
		return cli.Run(scheduler.NewSchedulerCommand())
	},
	"etcd": func() int {
		etcdmain.Main(os.Args)
		return 0
	},
	"kubectl": func() int {
		logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) //nolint:errcheck
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return 0
	},
}

func usage() int {
	names := make([]string, 0, len(components))
	for name := range components {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: batchknee-k8s {%s} [flags...]\n", strings.Join(names, "|"))
	fmt.Fprintln(os.Stderr, "   or: symlink this binary under one of those names and run the link.")
	return 2
}

func main() {
	name := filepath.Base(os.Args[0])
	run, ok := components[name]
	if !ok {
		if len(os.Args) < 2 {
			os.Exit(usage())
		}
		run, ok = components[os.Args[1]]
		if !ok {
			os.Exit(usage())
		}
		// Shift so the component sees itself as argv[0]; cobra and etcd read os.Args directly.
		os.Args = os.Args[1:]
	}
	os.Exit(run())
}
