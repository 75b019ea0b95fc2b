// stargz-grpc: the stargz snapshotter as a containerd proxy snapshotter, for bench/containerd.py.
//
// Debian packages the stargz-snapshotter library (golang-github-containerd-stargz-snapshotter-dev)
// and ctr-remote, but not the daemon (upstream's containerd-stargz-grpc).  This is the smallest
// daemon around that library, built by bench/peers/stargz.sh against Debian's own packages:
// the snapshotter exactly as the library configures it (its defaults unless the TOML config says
// otherwise), served over containerd's snapshots gRPC API on a unix socket.  No keychain: the
// bench's registry on 127.0.0.1 needs no credentials (and the library speaks plain HTTP to it).
//
//	stargz-grpc --address SOCKET --root DIR [--config FILE.toml]
//
// SIGTERM or SIGINT stops serving and closes the snapshotter, which unmounts every layer it mounted.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/log"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/pelletier/go-toml"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
)

func loadConfig(path string) (*service.Config, error) {
	var config service.Config
	if path == "" {
		return &config, nil
	}
	tree, err := toml.LoadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	if err := tree.Unmarshal(&config); err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return &config, nil
}

func run(address, root, configPath string) error {
	config, err := loadConfig(configPath)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("root %s: %w", root, err)
	}
	ctx := context.Background()
	sn, err := service.NewStargzSnapshotterService(ctx, root, config)
	if err != nil {
		return fmt.Errorf("stargz snapshotter on %s: %w", root, err)
	}
	defer sn.Close() // unmounts every layer, committed ones included

	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return fmt.Errorf("socket directory of %s: %w", address, err)
	}
	if err := os.Remove(address); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("stale socket %s: %w", address, err)
	}
	listener, err := net.Listen("unix", address)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", address, err)
	}
	server := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(sn))

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	log.G(ctx).Infof("serving on %s, root %s", address, root)
	select {
	case sig := <-signals:
		log.G(ctx).Infof("%v: stopping", sig)
		server.Stop()
		return nil
	case err := <-served:
		return fmt.Errorf("serving on %s: %w", address, err)
	}
}

func main() {
	address := flag.String("address", "", "unix socket to serve containerd's snapshots API on")
	root := flag.String("root", "", "the snapshotter's root directory (snapshots, caches, mount points)")
	configPath := flag.String("config", "", "TOML config (the library's service.Config); default: its defaults")
	level := flag.String("log-level", "info", "logrus level")
	flag.Parse()
	if *address == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "usage: stargz-grpc --address SOCKET --root DIR [--config FILE.toml] [--log-level LEVEL]")
		os.Exit(2)
	}
	lvl, err := logrus.ParseLevel(*level)
	if err != nil {
		fmt.Fprintf(os.Stderr, "stargz-grpc: --log-level %q: %v\n", *level, err)
		os.Exit(2)
	}
	logrus.SetLevel(lvl)
	if err := run(*address, *root, *configPath); err != nil {
		fmt.Fprintf(os.Stderr, "stargz-grpc: %v\n", err)
		os.Exit(1)
	}
}
