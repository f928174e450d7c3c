#!/usr/bin/env bash
# Offline verification of the Kubernetes deployment (no Docker engine, no cluster).
#
#   bash infra/verify-offline.sh           everything below; one summary line at the end
#   bash infra/verify-offline.sh --tools   only the pinned helm (docs/deploy.md section 5); quiet on stdout and
#                                          stderr unless it fails (the Go tool's output goes to .cache/tools/*.log)
#   bash infra/verify-offline.sh --tools all   every tool below, without the checks (tests/deploy)
#
# Tools (pinned in infra/versions.env, installed once under .cache/tools/, re-used on re-runs):
#   helm      go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION  (Go module proxy)
#   hclfmt    go install github.com/hashicorp/hcl/v2/cmd/hclfmt@$HCL_VERSION
#   CRDs      prometheus-operator Go module $PROMETHEUS_OPERATOR_VERSION (example/prometheus-operator-crd)
#   dockerfile-lint  infra/deploy/dockerfile-lint (BuildKit $BUILDKIT_VERSION's Dockerfile checks, no daemon)
#   promql-lint      infra/deploy/promql-lint (Prometheus $PROMETHEUS_VERSION's PromQL parser)
#   python    infra/requirements-deploy.txt into .cache/venv (else .cache/deploy-venv)
#   checkov   infra/requirements-checkov.txt into .cache/tools/checkov-venv
# Checks:
#   1. values.schema.json is generated from values.yaml (infra/deploy/gen_values_schema.py --check)
#   2. helm lint --strict: defaults and every helm/kappa/examples/*.yaml, for each Kubernetes version
#   3. helm template of each case -> .cache/deploy-verify/rendered/
#   4. every object (and the manifests embedded in ConfigMaps) against the Kubernetes JSON schemas of each
#      version in K8S_SCHEMA_VERSIONS (strict), Prometheus-operator objects against their CRD schemas
#   5. PromQL of the PrometheusRule alerts and the Grafana dashboard parses, and uses only metrics that
#      kappa/runtime/metrics.py exports
#   6. checkov (infra/deploy/checkov.yaml) on the rendered manifests and on infra/terraform: zero failures
#   7. BuildKit's Dockerfile checks on infra/images/*.Dockerfile and infra/images/bases/*.Dockerfile
#   8. Terraform: hclfmt syntax/format check; `fmt -check` with tofu/terraform when installed; `validate`
#      needs provider downloads and is reported as not run
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="$ROOT/.cache"
TOOLS="${KAPPA_DEPLOY_TOOLS:-$CACHE/tools}"   # another folder only for the tests of this script
OUT="$CACHE/deploy-verify"
CHART="$ROOT/helm/kappa"

die() { echo "verify-offline: $*" >&2; exit 1; }
# quiet <log> <command...>: the command's stdout and stderr (go's "go: downloading ..." lines) into the log; on
# failure its last lines on stderr
quiet() {
    local out="$1"; shift
    "$@" >"$out" 2>&1 && return 0
    local rc=$?
    tail -20 "$out" >&2
    return "$rc"
}
log() { echo "verify-offline: $*"; }

command -v go >/dev/null 2>&1 || die "go not found on PATH: Go (>= 1.24; newer toolchains come from the Go module proxy) builds helm, hclfmt and the lint tools"

# shellcheck disable=SC1091
set -a; source "$ROOT/infra/versions.env"; set +a
for v in HELM_VERSION HCL_VERSION PROMETHEUS_OPERATOR_VERSION K8S_SCHEMA_VERSIONS CHECKOV_VERSION KUBERNETES_VALIDATE_VERSION \
         BUILDKIT_VERSION PROMETHEUS_VERSION; do
    [[ -n "${!v:-}" ]] || die "infra/versions.env does not define $v"
done
mkdir -p "$TOOLS"
# one run at a time per tools folder (two test processes may ask for the tools together): the second waits, then
# finds them installed; the checks' output folder is shared too
exec 9>"$TOOLS/.verify.lock"
flock 9

# ------------------------------------------------------------------------------------------- tools
HELM="$TOOLS/helm"
install_helm() {
    if [[ -x "$HELM" ]] && [[ "$("$HELM" version --template '{{.Version}}' 2>/dev/null)" == "$HELM_VERSION" ]]; then
        return
    fi
    log "building helm $HELM_VERSION from the Go module proxy (one-off, a few minutes)"
    # the release Makefile's ldflags: version string and the default Kubernetes version (from client-go)
    local mod minor
    quiet "$TOOLS/helm-build.log" env GOFLAGS=-mod=mod go mod download "helm.sh/helm/v3@$HELM_VERSION" \
        || die "cannot download helm.sh/helm/v3@$HELM_VERSION from the Go module proxy"
    mod="$(go env GOMODCACHE 2>>"$TOOLS/helm-build.log")/cache/download/helm.sh/helm/v3/@v/$HELM_VERSION.mod"
    minor="$(awk '$1 == "k8s.io/client-go" { split($2, p, "."); print p[2] }' "$mod")"
    [[ -n "$minor" ]] || die "cannot read the client-go version of helm $HELM_VERSION"
    quiet "$TOOLS/helm-build.log" env GOBIN="$TOOLS" go install -trimpath -ldflags "-s -w \
        -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
        -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor \
        -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" || die "go install helm $HELM_VERSION failed"
    [[ "$("$HELM" version --template '{{.Version}}')" == "$HELM_VERSION" ]] || die "built helm does not report $HELM_VERSION"
}

HCLFMT="$TOOLS/hclfmt"
install_hclfmt() {
    local stamp="$TOOLS/.hclfmt-$HCL_VERSION"
    [[ -x "$HCLFMT" && -f "$stamp" ]] && return
    log "building hclfmt $HCL_VERSION"
    quiet "$TOOLS/hclfmt-build.log" env GOBIN="$TOOLS" go install -trimpath -ldflags "-s -w" "github.com/hashicorp/hcl/v2/cmd/hclfmt@$HCL_VERSION" \
        || die "go install hclfmt $HCL_VERSION failed"
    rm -f "$TOOLS"/.hclfmt-*; touch "$stamp"
}

# small Go programs of this repository (go.mod/go.sum pinned), rebuilt only when their sources change
build_go_tool() {  # build_go_tool <name>
    local name="$1" src="$ROOT/infra/deploy/$1" stamp hash
    hash="$(cat "$src"/go.mod "$src"/go.sum "$src"/*.go | sha256sum | cut -c1-16)"
    stamp="$TOOLS/.$name-$hash"
    [[ -x "$TOOLS/$name" && -f "$stamp" ]] && return
    log "building $name (infra/deploy/$name)"
    (cd "$src" && quiet "$TOOLS/$name-build.log" go build -trimpath -ldflags "-s -w" -o "$TOOLS/$name" .) || die "go build $name failed"
    rm -f "$TOOLS"/."$name"-*; touch "$stamp"
}

CRD_DIR=""
fetch_crds() {
    local dir
    dir="$(GOFLAGS=-mod=mod go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" 2>"$TOOLS/crds-download.log" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')" \
        || die "cannot download the prometheus-operator module $PROMETHEUS_OPERATOR_VERSION"
    CRD_DIR="$dir/example/prometheus-operator-crd"
    [[ -f "$CRD_DIR/monitoring.coreos.com_podmonitors.yaml" ]] || CRD_DIR=""
}

# Python: the project venv if it exists, else a dedicated one; installs only when the requirements change.
if [[ -x "$CACHE/venv/bin/python" ]]; then PYVENV="$CACHE/venv"; else PYVENV="$CACHE/deploy-venv"; fi
PY="$PYVENV/bin/python"
pip_install() {  # pip_install <venv> <requirements file>
    local venv="$1" req="$2" stamp hash
    hash="$(sha256sum "$req" | cut -c1-16)"
    stamp="$venv/.kappa-$(basename "$req" .txt)-$hash"
    [[ -f "$stamp" ]] && return
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" || die "cannot create $venv (python3 -m venv)"
    log "pip install -r ${req#"$ROOT"/} into ${venv#"$ROOT"/}"
    local installer=("$venv/bin/python" -m pip install -q)
    # the project venv's uv (infra/local/bootstrap.sh) when there is one: several times faster than pip
    [[ -x "$CACHE/venv/bin/uv" ]] && installer=("$CACHE/venv/bin/uv" pip install --quiet --python "$venv/bin/python")
    "${installer[@]}" -r "$req" >"$venv/.pip-$(basename "$req" .txt).log" 2>&1 \
        || die "pip install -r $req failed; see $venv/.pip-$(basename "$req" .txt).log"
    rm -f "$venv"/.kappa-"$(basename "$req" .txt)"-*; touch "$stamp"
}

install_helm
if [[ "${1:-}" == "--tools" && "${2:-}" != "all" ]]; then
    log "tools ready: helm $HELM_VERSION (.cache/tools/helm)"
    exit 0
fi
install_hclfmt
fetch_crds
build_go_tool dockerfile-lint
build_go_tool promql-lint
pip_install "$PYVENV" "$ROOT/infra/requirements-deploy.txt"
CHECKOV_VENV="$TOOLS/checkov-venv"
pip_install "$CHECKOV_VENV" "$ROOT/infra/requirements-checkov.txt"
if [[ "${1:-}" == "--tools" ]]; then
    log "tools ready: helm $HELM_VERSION, hclfmt $HCL_VERSION, checkov $CHECKOV_VERSION, python ${PY#"$ROOT"/}"
    exit 0
fi

# ------------------------------------------------------------------------------------------- checks
rm -rf "$OUT"; mkdir -p "$OUT/rendered" "$OUT/policy"
IFS=',' read -r -a KUBE_VERSIONS <<<"$K8S_SCHEMA_VERSIONS"
MIN_KUBE="${KUBE_VERSIONS[0]}"

log "1/8 values.schema.json is up to date"
"$PY" infra/deploy/gen_values_schema.py --check

# render cases: name|values args|capability args (lint has no --api-versions: it lints the values only)
CASES=("defaults||" "defaults-prometheus-operator||--api-versions monitoring.coreos.com/v1")
for f in "$CHART"/examples/*.yaml; do
    CASES+=("$(basename "$f" .yaml)|-f $f|--api-versions monitoring.coreos.com/v1")
done

log "2/8 helm lint --strict (${#CASES[@]} value sets x Kubernetes ${KUBE_VERSIONS[*]})"
lints=0
for case in "${CASES[@]}"; do
    IFS='|' read -r name args _ <<<"$case"
    for kv in "${KUBE_VERSIONS[@]}"; do
        # shellcheck disable=SC2086
        "$HELM" lint --strict "$CHART" --namespace kappa --kube-version "$kv" $args >"$OUT/lint-$name-$kv.log" 2>&1 \
            || { cat "$OUT/lint-$name-$kv.log"; die "helm lint failed for $name (Kubernetes $kv)"; }
        lints=$((lints + 1))
    done
done

log "3/8 helm template"
objects=0
for case in "${CASES[@]}"; do
    IFS='|' read -r name args caps <<<"$case"
    # shellcheck disable=SC2086
    "$HELM" template kappa "$CHART" --namespace kappa --kube-version "$MIN_KUBE" $args $caps \
        >"$OUT/rendered/$name.yaml" 2>"$OUT/template-$name.log" \
        || { cat "$OUT/template-$name.log"; die "helm template failed for $name"; }
    n="$(grep -c '^kind: ' "$OUT/rendered/$name.yaml" || true)"
    objects=$((objects + n))
    echo "  $name: $n objects"
done

log "4/8 schema validation (Kubernetes $K8S_SCHEMA_VERSIONS${CRD_DIR:+, prometheus-operator $PROMETHEUS_OPERATOR_VERSION CRDs})"
"$PY" infra/deploy/validate_manifests.py --k8s "$K8S_SCHEMA_VERSIONS" ${CRD_DIR:+--crd-dir "$CRD_DIR"} \
    --extract "$OUT/embedded" --json "$OUT/schemas.json" "$OUT"/rendered/*.yaml infra/cluster/*namespace.yaml \
    || die "schema validation failed (see above)"

log "5/8 PromQL: alert rules and dashboard queries (promql-lint, Prometheus $PROMETHEUS_VERSION parser)"
metrics="$("$PY" infra/deploy/exported_metrics.py)" || die "cannot read the exported metrics from kappa/runtime/metrics.py"
"$TOOLS/promql-lint" -metrics "$metrics" -dashboard "$CHART/files/grafana-dashboard.json" "$OUT"/rendered/*.yaml \
    | tee "$OUT/promql.log" | sed 's/^/  /' ; [[ "${PIPESTATUS[0]}" == 0 ]] || die "PromQL check failed"
promql="$(sed -n 's/^promql-lint: \([0-9]*\) expressions.*/\1/p' "$OUT/promql.log")"

log "6/8 policy check: checkov $CHECKOV_VERSION (config infra/deploy/checkov.yaml)"
cp "$OUT"/rendered/*.yaml "$OUT/policy/"
# the runner's Deployments/Jobs/Services (view template filled with sample values); the executor pod template is a
# partial pod spec completed by Spark (resources, image, probes-free executors) and is schema-checked only
"$PY" - "$OUT/embedded" "$OUT/policy" <<'EOF'
import sys, pathlib, yaml
src, dst = map(pathlib.Path, sys.argv[1:])
for f in sorted(src.glob("*.yaml")):
    docs = [d for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") in ("Deployment", "Job", "Service")]
    if docs:
        (dst / f.name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
EOF
policy_summary() {  # policy_summary <json file> <label>
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
reports = data if isinstance(data, list) else [data]
p = f = 0
for r in reports:
    s = r.get("summary", {})
    p += s.get("passed", 0); f += s.get("failed", 0)
    for c in r.get("results", {}).get("failed_checks", []):
        print(f"    FAIL {c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})")
print(f"  {sys.argv[2]}: {p} passed, {f} failed")
open(sys.argv[1] + ".counts", "w").write(f"{p} {f}\n")
EOF
}
run_checkov() {  # run_checkov <label> <json out> <checkov args...>
    local label="$1" out="$2"; shift 2
    (cd "$OUT" && "$CHECKOV_VENV/bin/checkov" --config-file "$ROOT/infra/deploy/checkov.yaml" --quiet --compact \
        --skip-download -o json "$@" >"$out" 2>"$out.log") || true
    [[ -s "$out" ]] || { cat "$out.log"; die "checkov ($label) produced no report"; }
    policy_summary "$out" "$label"
}
# relative path: checkov ignores files below hidden directories such as .cache/ when given absolute paths
run_checkov kubernetes "$OUT/checkov-k8s.json" -d policy --framework kubernetes
run_checkov terraform "$OUT/checkov-tf.json" -d "$ROOT/infra/terraform" --framework terraform
read -r k8s_pass k8s_fail <"$OUT/checkov-k8s.json.counts"
read -r tf_pass tf_fail <"$OUT/checkov-tf.json.counts"
disabled="$(grep -cE '^[[:space:]]*- CKV' infra/deploy/checkov.yaml)"
echo "  disabled checks ($disabled, reasons in infra/deploy/checkov.yaml): $(grep -oE '^[[:space:]]*- CKV[A-Z0-9_]+' infra/deploy/checkov.yaml | tr -d ' -' | paste -sd, -)"
((k8s_fail == 0 && tf_fail == 0)) || die "policy check failed: $k8s_fail Kubernetes + $tf_fail Terraform failures"

log "7/8 Dockerfiles: BuildKit $BUILDKIT_VERSION checks (dockerfile-lint)"
"$TOOLS/dockerfile-lint" infra/images/*.Dockerfile infra/images/bases/*.Dockerfile | sed 's/^/  /'; [[ "${PIPESTATUS[0]}" == 0 ]] || die "Dockerfile check failed"
dockerfiles="$(ls infra/images/*.Dockerfile infra/images/bases/*.Dockerfile | wc -l)"

log "8/8 Terraform (infra/terraform)"
"$HCLFMT" -check -require-no-change infra/terraform/*.tf infra/terraform/*.tfvars >/dev/null \
    || die "hclfmt: infra/terraform has syntax errors or is not canonically formatted (run: $HCLFMT -w infra/terraform/*.tf)"
echo "  hclfmt $HCL_VERSION: syntax + canonical format OK"
tf_fmt="not installed"
for tf in tofu terraform; do
    if command -v "$tf" >/dev/null 2>&1; then
        TF_CLI_CONFIG_FILE=/dev/null "$tf" fmt -check -recursive infra/terraform >/dev/null \
            || die "$tf fmt -check failed (run: $tf fmt -recursive infra/terraform)"
        tf_fmt="$tf fmt -check OK ($(TF_CLI_CONFIG_FILE=/dev/null "$tf" version 2>/dev/null | head -1))"
        break
    fi
done
echo "  fmt: $tf_fmt; validate: not run (needs the hashicorp/aws provider from registry.terraform.io)"

read -r schema_objects schema_passed schema_failed schema_skipped < <("$PY" -c "
import json; d = json.load(open('$OUT/schemas.json')); print(d['objects'], d['passed'], len(d['failed']), len(d['skipped']))")
cat >"$OUT/summary.json" <<EOF
{"helm": "$HELM_VERSION", "lint_runs": $lints, "render_cases": ${#CASES[@]}, "objects_rendered": $objects,
 "schema_objects": $schema_objects, "schema_passed": $schema_passed, "schema_failed": $schema_failed, "schema_skipped": $schema_skipped,
 "policy_k8s_passed": $k8s_pass, "policy_k8s_failed": $k8s_fail, "policy_tf_passed": $tf_pass, "policy_tf_failed": $tf_fail,
 "policy_disabled": $disabled, "promql_expressions": $promql, "dockerfiles_linted": $dockerfiles}
EOF
log "OK | helm $HELM_VERSION: $lints lint runs, ${#CASES[@]} value sets, $objects objects rendered" \
    "| schemas: $schema_passed passed, $schema_failed failed, $schema_skipped skipped" \
    "| promql: $promql expressions OK | dockerfiles: $dockerfiles OK" \
    "| checkov: k8s $k8s_pass passed/$k8s_fail failed, terraform $tf_pass passed/$tf_fail failed, $disabled disabled" \
    "| terraform: hclfmt OK, $tf_fmt, validate not run"
