#!/usr/bin/env bash
# What helm/kappa/examples/production.yaml expects to exist before its install (docs/deploy.md, section 2), made on
# this machine's nodes: the namespace kappa (Pod Security "restricted"), the lake's credential as a Secret
# (kappa-lake-s3: the object store's platform credential, where production uses an IRSA role), the Airflow Secret
# (kappa-airflow-secrets: fernet-key, api-secret-key, jwt-secret, admin-password, generated once), and the external
# Airflow database: a PostgreSQL in namespace kappa-db (infra/k8s/production/airflow-database.yaml), its password
# generated once, and the release's Secret kappa-airflow-db (key connection) pointing at it.
# Needs a running cluster (make cluster-up NODES=3), the provisioner (infra/k8s/node.sh provisioner) and the object
# store with its S3 gateway reachable from pods (make objectstore-up S3_BIND=0.0.0.0). Idempotent: Secrets that
# exist are kept (the volumes they initialised stay with them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
die() { echo "production: error: $*" >&2; exit 1; }
log() { echo "production: $*" >&2; }
PY="$ROOT/.cache/venv/bin/python"
[[ -x "$PY" ]] || die "no $PY (make setup)"
KUBECTL="$(bash "$ROOT/infra/k8s/build.sh")/kubectl"   # the pinned one
kubectl() { "$KUBECTL" --kubeconfig "${KUBECONFIG:-$ROOT/.kappa/cluster/admin.kubeconfig}" "$@"; }
kubectl get nodes >/dev/null 2>&1 || die "no cluster answers (make cluster-up NODES=3)"
kubectl get storageclass local-path >/dev/null 2>&1 || die "no StorageClass local-path (bash infra/k8s/node.sh provisioner)"
status="$("$PY" -m kappa.objectstore status 2>&1)" || die "the object store is not running (make objectstore-up S3_BIND=0.0.0.0)"
[[ "$status" == *"S3 also on 0.0.0.0:"* ]] \
    || die "the object store's S3 gateway listens on loopback only: pods cannot reach it (make objectstore-down, then make objectstore-up S3_BIND=0.0.0.0)"
random() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(32))'; }
absent() { ! kubectl -n "$1" get secret "$2" >/dev/null 2>&1; }

kubectl apply -f "$ROOT/infra/cluster/namespace.yaml" >/dev/null
if absent kappa kappa-lake-s3; then
    kubectl -n kappa create secret generic kappa-lake-s3 --from-env-file=<("$PY" -m kappa.objectstore secret-env) >/dev/null
    log "created Secret kappa/kappa-lake-s3 (the object store's platform credential)"
fi
if absent kappa kappa-airflow-secrets; then
    fernet="$("$PY" -c 'import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())')"
    kubectl -n kappa create secret generic kappa-airflow-secrets --from-literal=fernet-key="$fernet" \
        --from-literal=api-secret-key="$(random)" --from-literal=jwt-secret="$(random)" \
        --from-literal=admin-password="$(random)" >/dev/null
    log "created Secret kappa/kappa-airflow-secrets"
fi
kubectl apply -f "$ROOT/infra/k8s/production/airflow-database.yaml" >/dev/null
if absent kappa-db kappa-airflow-db-password; then
    kubectl -n kappa-db create secret generic kappa-airflow-db-password --from-literal=password="$(random)" >/dev/null
    log "created Secret kappa-db/kappa-airflow-db-password"
fi
password="$(kubectl -n kappa-db get secret kappa-airflow-db-password -o jsonpath='{.data.password}' | base64 -d)"
kubectl -n kappa create secret generic kappa-airflow-db --dry-run=client -o yaml \
    --from-literal=connection="postgresql+psycopg2://airflow:$password@airflow-db.kappa-db.svc:5432/airflow" \
    | kubectl apply -f - >/dev/null
kubectl -n kappa-db rollout status statefulset/airflow-db --timeout=300s >/dev/null \
    || die "the Airflow database is not ready (kubectl -n kappa-db describe pod airflow-db-0)"
log "ready: namespace kappa, Secrets kappa-lake-s3, kappa-airflow-secrets, kappa-airflow-db;" \
    "PostgreSQL airflow-db.kappa-db.svc:5432 on $(kubectl -n kappa-db get pod airflow-db-0 -o jsonpath='{.spec.nodeName}')"
