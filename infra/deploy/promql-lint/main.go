// Command promql-lint parses every PromQL expression the chart ships -- the alert rules of rendered
// PrometheusRule objects and the queries of the Grafana dashboard -- with Prometheus' own parser, so a syntax
// error is caught offline instead of silently never firing / never drawing. It also checks that every
// kappa_* metric referenced is one the platform exports.
//
// Usage: promql-lint -metrics kappa_a,kappa_b [-dashboard file.json] rendered.yaml...
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"

	"github.com/prometheus/prometheus/promql/parser"
	"gopkg.in/yaml.v3"
)

type rule struct {
	Alert  string `yaml:"alert"`
	Record string `yaml:"record"`
	Expr   string `yaml:"expr"`
}

type object struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Spec struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	} `yaml:"spec"`
}

type query struct{ where, expr string }

// Grafana template variables -> valid PromQL stand-ins
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h")
var grafanaVar = regexp.MustCompile(`\$\{?[A-Za-z_][A-Za-z0-9_]*\}?`)

func fromRendered(path string) ([]query, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []query
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	for {
		var o object
		if err := dec.Decode(&o); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if o.Kind != "PrometheusRule" {
			continue
		}
		for _, g := range o.Spec.Groups {
			for _, r := range g.Rules {
				out = append(out, query{fmt.Sprintf("%s: PrometheusRule/%s %s/%s%s", path, o.Metadata.Name, g.Name, r.Alert, r.Record), r.Expr})
			}
		}
	}
}

func fromDashboard(path string) ([]query, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var out []query
	for _, p := range dash.Panels {
		for _, t := range p.Targets {
			expr := grafanaVar.ReplaceAllString(grafanaVars.Replace(t.Expr), ".*")
			out = append(out, query{fmt.Sprintf("%s: panel %q", path, p.Title), expr})
		}
	}
	return out, nil
}

func main() {
	metrics := flag.String("metrics", "", "comma-separated metric names the platform exports")
	dashboard := flag.String("dashboard", "", "Grafana dashboard JSON")
	flag.Parse()
	known := map[string]bool{}
	for _, m := range strings.Split(*metrics, ",") {
		if m = strings.TrimSpace(m); m != "" {
			known[m] = true
		}
	}
	var queries []query
	for _, f := range flag.Args() {
		q, err := fromRendered(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		queries = append(queries, q...)
	}
	if *dashboard != "" {
		q, err := fromDashboard(*dashboard)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		queries = append(queries, q...)
	}
	bad := 0
	for _, q := range queries {
		expr, err := parser.NewParser(parser.Options{}).ParseExpr(q.expr)
		if err != nil {
			bad++
			fmt.Printf("%s: %v\n", q.where, err)
			continue
		}
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			if vs, ok := n.(*parser.VectorSelector); ok && strings.HasPrefix(vs.Name, "kappa_") && len(known) > 0 {
				name := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(vs.Name, "_bucket"), "_sum"), "_count")
				if !known[name] && !known[vs.Name] {
					bad++
					fmt.Printf("%s: unknown metric %s\n", q.where, vs.Name)
				}
			}
			return nil
		})
	}
	fmt.Printf("promql-lint: %d expressions parsed, %d problems\n", len(queries), bad)
	if len(queries) == 0 || bad > 0 {
		os.Exit(1)
	}
}
