// Command dockerfile-lint runs BuildKit's own Dockerfile checks (what `docker build --check` reports: syntax,
// ARG/ENV usage, stage names, casing, JSON-form CMD/ENTRYPOINT, ...) without a Docker daemon or registry:
// base images resolve to an empty linux/amd64 image config instead of being pulled.
//
// Usage: dockerfile-lint Dockerfile...   (exit status 1 on any warning or build error)
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/moby/buildkit/client/llb"
	"github.com/moby/buildkit/client/llb/sourceresolver"
	"github.com/moby/buildkit/frontend/dockerfile/dockerfile2llb"
	digest "github.com/opencontainers/go-digest"
)

type offlineResolver struct{}

func (offlineResolver) ResolveImageConfig(_ context.Context, ref string, _ sourceresolver.Opt) (string, digest.Digest, []byte, error) {
	cfg, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config":       map[string]any{"Env": []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{}},
	})
	if err != nil {
		return "", "", nil, err
	}
	return ref, digest.FromBytes(cfg), cfg, nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: dockerfile-lint Dockerfile...")
		os.Exit(2)
	}
	failed := false
	for _, path := range os.Args[1:] {
		dt, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			os.Exit(2)
		}
		sourceMap := llb.NewSourceMap(nil, path, "Dockerfile", dt)
		sourceMap.Definition = &llb.Definition{} // no build context: only the Dockerfile text is linted
		res, err := dockerfile2llb.DockerfileLint(context.Background(), dt, dockerfile2llb.ConvertOpt{
			SourceMap:    sourceMap,
			MetaResolver: offlineResolver{},
		})
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			os.Exit(2)
		}
		if res.Error != nil {
			failed = true
			line := int32(0)
			if len(res.Error.Location.Ranges) > 0 {
				line = res.Error.Location.Ranges[0].Start.Line
			}
			fmt.Printf("%s:%d: build error: %s\n", path, line, res.Error.Message)
		}
		for _, w := range res.Warnings {
			failed = true
			line := int32(0)
			if w.Location != nil && len(w.Location.Ranges) > 0 {
				line = w.Location.Ranges[0].Start.Line
			}
			fmt.Printf("%s:%d: %s: %s (%s)\n", path, line, w.RuleName, w.Detail, w.URL)
		}
		if res.Error == nil && len(res.Warnings) == 0 {
			fmt.Printf("%s: ok\n", path)
		}
	}
	if failed {
		os.Exit(1)
	}
}
