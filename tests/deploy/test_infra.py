"""infra/terraform (parsed HCL) and infra/cluster manifests; the policy-check configuration."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

import deploy_helpers as h

pytestmark = pytest.mark.deploy

TF = h.ROOT / "infra" / "terraform"


@pytest.fixture(scope="module")
def tf() -> dict[str, Any]:
    hcl2 = pytest.importorskip("hcl2", reason="pip install -r infra/requirements-deploy.txt")
    merged: dict[str, list] = {}
    for path in sorted(TF.glob("*.tf")):
        with path.open() as fh:
            for key, value in hcl2.load(fh).items():
                merged.setdefault(key, []).extend(value)
    return unquote(merged)


def unquote(node: Any) -> Any:
    """python-hcl2 >= 7 keeps HCL string quotes; compare plain values."""
    if isinstance(node, str):
        return node[1:-1] if len(node) >= 2 and node[0] == node[-1] == '"' else node
    if isinstance(node, dict):
        return {unquote(k): unquote(v) for k, v in node.items() if k != "__is_block__"}
    if isinstance(node, list):
        return [unquote(v) for v in node]
    return node


def blocks(tf: dict, kind: str, type_: str) -> dict[str, dict]:
    out = {}
    for entry in tf.get(kind, []):
        for t, named in entry.items():
            if t.strip('"') == type_:
                for name, body in named.items():
                    out[name.strip('"')] = body
    return out


def one(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def test_bucket_is_versioned_encrypted_and_private(tf: dict) -> None:
    assert "lake" in blocks(tf, "resource", "aws_s3_bucket")
    versioning = blocks(tf, "resource", "aws_s3_bucket_versioning")["lake"]
    assert one(versioning["versioning_configuration"])["status"] == "Enabled"
    sse = one(blocks(tf, "resource", "aws_s3_bucket_server_side_encryption_configuration")["lake"]["rule"])
    default = one(sse["apply_server_side_encryption_by_default"])
    assert default["sse_algorithm"] == "aws:kms" and sse["bucket_key_enabled"] is True
    pab = blocks(tf, "resource", "aws_s3_bucket_public_access_block")["lake"]
    for key in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert pab[key] is True, key
    assert one(blocks(tf, "resource", "aws_s3_bucket_ownership_controls")["lake"]["rule"])["object_ownership"] == "BucketOwnerEnforced"
    kms = blocks(tf, "resource", "aws_kms_key")["lake"]
    assert kms["enable_key_rotation"] is True
    tls = one(blocks(tf, "data", "aws_iam_policy_document")["bucket"]["statement"])
    assert tls["effect"] == "Deny" and one(tls["condition"])["variable"] == "aws:SecureTransport"


def test_jobs_role_is_irsa_scoped_to_the_chart_service_accounts(tf: dict) -> None:
    assume = one(blocks(tf, "data", "aws_iam_policy_document")["jobs_assume"]["statement"])
    assert assume["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    assert one(assume["principals"])["type"] == "Federated"
    variables = {one(c["variable"]) if isinstance(c["variable"], list) else c["variable"] for c in assume["condition"]}
    assert any(v.endswith(":sub}") or v.endswith(":sub") for v in variables)
    assert any(v.endswith(":aud}") or v.endswith(":aud") for v in variables)
    variables_tf = {k.strip('"'): v for entry in tf["variable"] for k, v in entry.items()}
    assert variables_tf["service_accounts"]["default"] == ["kappa-view", "kappa-airflow", "kappa-lake-check", "kappa-sql"]
    # ... which are the ServiceAccounts the chart gives IRSA to
    prod = h.render(h.CHART / "examples" / "production.yaml")
    annotated = sorted(sa["metadata"]["name"] for sa in h.by_kind(prod, "ServiceAccount")
                       if "eks.amazonaws.com/role-arn" in sa["metadata"].get("annotations", {}))
    assert annotated == sorted(variables_tf["service_accounts"]["default"])
    policy = blocks(tf, "data", "aws_iam_policy_document")["jobs"]["statement"]
    actions = {a for s in policy for a in s["actions"]}
    assert "s3:*" not in actions and "*" not in actions
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= actions


def test_outputs_feed_the_chart(tf: dict) -> None:
    outputs = {k.strip('"') for entry in tf["output"] for k in entry}
    assert {"bucket_name", "bucket_arn", "lake_uri", "jobs_role_arn", "kms_key_arn", "helm_values"} <= outputs
    text = (TF / "outputs.tf").read_text()
    assert 'uri         = "s3a://' in text and "irsaRoleArn = aws_iam_role.jobs.arn" in text


def test_terraform_files_are_canonical_hcl() -> None:
    hclfmt = h.TOOLS / "hclfmt"
    if not hclfmt.exists():
        pytest.skip("hclfmt not built yet (bash infra/verify-offline.sh --tools)")
    import subprocess

    res = subprocess.run([str(hclfmt), "-check", "-require-no-change", *map(str, sorted(TF.glob("*.tf")))],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_cluster_namespace_enforces_restricted() -> None:
    ns = yaml.safe_load((h.ROOT / "infra" / "cluster" / "namespace.yaml").read_text())
    assert ns["kind"] == "Namespace" and ns["metadata"]["name"] == h.NAMESPACE
    labels = ns["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    mon = yaml.safe_load((h.ROOT / "infra" / "cluster" / "monitoring-namespace.yaml").read_text())
    values = yaml.safe_load((h.CHART / "values.yaml").read_text())
    assert values["networkPolicy"]["metrics"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == mon["metadata"]["name"]


def test_every_disabled_policy_check_has_a_reason() -> None:
    lines = (h.ROOT / "infra" / "deploy" / "checkov.yaml").read_text().splitlines()
    cfg = yaml.safe_load("\n".join(lines))
    assert set(cfg) == {"skip-check"}, "only skips, nothing else is tuned"
    for i, line in enumerate(lines):
        m = re.match(r"\s*- (CKV\S+)", line)
        if m:
            reason = []
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("#") and not re.match(r"\s*# ---", lines[j]):
                reason.insert(0, lines[j])
                j -= 1
            text = " ".join(reason)
            assert m.group(1) in text and len(text) > 80, f"{m.group(1)}: no reason above it"
    assert len(cfg["skip-check"]) <= 6  # each one argued above it; a new one needs its reason here too
    for path in list((h.CHART / "templates").rglob("*")) + list(TF.glob("*.tf")):
        if path.is_file():
            assert "checkov:skip" not in path.read_text() and "checkov.io/skip" not in path.read_text(), path


def test_verify_offline_tools_builds_only_helm_quietly(tmp_path) -> None:
    """docs/deploy.md section 5 runs ``verify-offline.sh --tools >/dev/null`` for the pinned helm: it builds helm
    alone (not hclfmt, the lint tools, the CRDs, checkov) and says nothing on stderr - Go's ``go: downloading``
    lines go to a log. A stand-in ``go`` on PATH prints those lines and records what it was asked to do."""
    import subprocess

    want = h.versions()["HELM_VERSION"]
    bin_dir, tools, modcache = tmp_path / "bin", tmp_path / "tools", tmp_path / "mod"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "go").write_text(f"""#!/bin/bash
echo "$*" >> {calls}
echo "go: downloading helm.sh/helm/v3 {want}" >&2
case "$1" in
  env) echo {modcache} ;;
  mod) d={modcache}/cache/download/helm.sh/helm/v3/@v; mkdir -p "$d"
       printf 'module helm.sh/helm/v3\\nrequire (\\n\\tk8s.io/client-go v0.33.3\\n)\\n' > "$d/{want}.mod" ;;
  install) printf '#!/bin/sh\\necho {want}\\n' > "$GOBIN/helm"; chmod +x "$GOBIN/helm" ;;
  *) exit 3 ;;
esac
""")
    (bin_dir / "go").chmod(0o755)
    env = {**__import__("os").environ, "PATH": f"{bin_dir}:{__import__('os').environ['PATH']}",
           "KAPPA_DEPLOY_TOOLS": str(tools)}
    res = subprocess.run(["bash", str(h.ROOT / "infra" / "verify-offline.sh"), "--tools"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=h.ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", f"--tools >/dev/null printed: {res.stderr!r}"
    # the tools and nothing else (their build logs and the run's lock file aside)
    assert sorted(p.name for p in tools.iterdir() if not p.name.endswith(".log") and not p.name.startswith(".")) \
        == ["helm"]
    asked = calls.read_text().splitlines()
    assert [a.split()[0] for a in asked] == ["mod", "env", "install"], asked
    assert any("helm.sh/helm/v3/cmd/helm@" in a for a in asked)
    # a failing build says why on stderr
    (tools / "helm").unlink()
    (bin_dir / "go").write_text("#!/bin/bash\necho 'go: module lookup disabled' >&2\nexit 1\n")
    res = subprocess.run(["bash", str(h.ROOT / "infra" / "verify-offline.sh"), "--tools"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=h.ROOT, timeout=120)
    assert res.returncode != 0 and "module lookup disabled" in res.stderr and "cannot download helm" in res.stderr


def test_k8s_build_waits_for_another_build_of_the_same_folder(tmp_path) -> None:
    """Every clone on the machine shares ``~/.cache/kappa/k8s`` (``make test`` beside ``make test-smoke``, two
    checkouts): a second ``infra/k8s/build.sh`` waits for the build that holds the folder, then builds only what is
    still missing - here nothing, so it never calls ``go``. The first build is stood in for by this test holding
    the folder's lock and writing the last binary before letting go; ``go`` is a stand-in that records a call."""
    import fcntl
    import os
    import subprocess
    import time
    from pathlib import Path

    cache = tmp_path / "cache"
    build = ["bash", str(h.ROOT / "infra" / "k8s" / "build.sh")]
    folder = subprocess.run(build, env={**os.environ, "KAPPA_TOOLS_CACHE": str(cache), "KAPPA_K8S_NO_BUILD": "1"},
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    bin_dir = Path(folder)
    bin_dir.mkdir(parents=True)
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kwok-stages.yaml"):
        (bin_dir / name).write_text("built\n")
    fake = tmp_path / "fakebin"
    fake.mkdir()
    calls = tmp_path / "go-calls"
    (fake / "go").write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\nexit 7\n")
    (fake / "go").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "KAPPA_TOOLS_CACHE": str(cache)}
    with open(bin_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = subprocess.Popen(build, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=h.ROOT)
        time.sleep(2)
        assert second.poll() is None, "the second build did not wait for the folder's lock"
        (bin_dir / "kubectl").write_text("built\n")  # what the first build left
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.strip() == str(bin_dir)
    assert "waiting for it" in err
    assert not calls.exists(), f"the second build built again: {calls.read_text()}"
