"""Runs view-version drivers as Kubernetes Deployments (live) or Jobs (bounded), built from the chart's template.

The chart (``helm/kappa``) renders the view-driver Deployment (and, in Spark-on-Kubernetes mode, the driver's
headless Service) from one named template. It renders the same template once more with placeholders into the
ConfigMap ``<release>-view-template``, which the Airflow pods mount at ``$KAPPA_VIEW_TEMPLATE_DIR``
(``/etc/kappa/view-template``)::

    deployment.yaml    Deployment with __KAPPA_VIEW__, __KAPPA_VIEW_SLUG__, __KAPPA_VERSION__, __KAPPA_STARTING__
    service.yaml       driver Service (Spark-on-Kubernetes mode only)

:meth:`KubernetesRunner.manifest` fills the placeholders, so a replay started from a DAG creates exactly the
object ``helm install`` would have created for that view version: same labels and selector, ``Recreate``
strategy with one replica (one driver per checkpoint), image, environment, ports, probes, security context
and resources. ``tests/deploy`` asserts this against ``helm template``.

A bounded replay (``JobSpec.end_timestamp_ms``) stops by itself once it passed its end; under a Deployment the
kubelet would restart the finished driver forever, so :meth:`KubernetesRunner.job_manifest` wraps the very same
pod template in a ``batch/v1`` Job (``restartPolicy: OnFailure``, ``backoffLimit``): a crash restarts the driver
from its checkpoint, a clean exit completes the Job, and :meth:`KubernetesRunner.status` reports ``finished``.

:meth:`KubernetesRunner.status` of a running driver carries its metrics URL: ``http://<pod IP>:<port>/metrics`` of
its Ready pod, the port being the pod's container port ``metrics`` (``m-<i>`` of the grouped driver for the i-th
version it hosts) - the endpoint the chart's PodMonitor scrapes, so the watch after a promotion
(:mod:`kappa.control.replay.watch`) reads what Prometheus reads. Whether it can be reached from where the caller runs
is the NetworkPolicies' business; the watch judges the version on its checkpoint when it cannot.

What the runner did outlives it: the chart renders its drivers from values, and a promote deletes the replaced
version's Deployment (or, with ``viewJobs.grouping=grouped``, the version runs inside the chart's grouped driver). So
every start and stop is recorded in the ConfigMap ``<release>-view-state`` (``views.json``:
``{view: {version: {"state": "running"|"stopped", "starting", "args", "env", "by", "at"}}}``, the names come from
the template's ``runner.json``). The chart reads it back on ``helm upgrade`` (``kappa.runningViews``): a version the
runner stopped stays stopped, a version it started is rendered exactly as started (so Helm adopts the object
instead of recreating it), and the grouped driver, which mounts the file, stops a version the runner took over.

The official ``kubernetes`` client is imported only when the API is called (``start``/``stop``/``status``);
``manifest`` is pure and needs nothing but PyYAML.

Example:
    >>> runner = KubernetesRunner.from_env()                       # doctest: +SKIP
    >>> runner.manifest("user_sessions", 2, "earliest")["metadata"]["name"]  # doctest: +SKIP
    'kappa-view-user-sessions-v2'
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kappa.errors import KappaError
from kappa.identity import view_ref

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = [
    "PLACEHOLDERS",
    "KubernetesRunner",
    "KubernetesRunnerError",
    "validate_starting",
    "view_slug",
]

#: Where the chart mounts the view-template ConfigMap (``deployment.yaml``, ``service.yaml``) unless
#: ``KAPPA_VIEW_TEMPLATE_DIR`` says otherwise; the namespace is ``KAPPA_K8S_NAMESPACE`` (the chart sets it from
#: the downward API), else the template's, else the pod's.
DEFAULT_TEMPLATE_DIR = "/etc/kappa/view-template"

PLACEHOLDERS = {
    "view": "__KAPPA_VIEW__",
    "slug": "__KAPPA_VIEW_SLUG__",
    "version": "__KAPPA_VERSION__",
    "starting": "__KAPPA_STARTING__",
}
_PLACEHOLDER_RE = re.compile(r"__KAPPA_(?:VIEW_SLUG|VIEW|VERSION|STARTING)__")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VIEW_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_SERVICE_ACCOUNT_NS = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_INSTALL_HINT = "the Kubernetes runner needs the official client: pip install kubernetes"
#: Restarts of a crashing bounded driver before its Job fails (each resumes from the checkpoint).
JOB_BACKOFF_LIMIT = 6
#: Restarts after which a live driver's container whose last run ended in an error is reported ``failed``
CRASH_LOOP_RESTARTS = 2
#: A finished bounded Job (and its pod's logs) is kept this long for status and post-mortems.
JOB_TTL_SECONDS = 7 * 24 * 3600


class KubernetesRunnerError(KappaError, RuntimeError):
    """Invalid request, missing template/client, or a Kubernetes API failure (one-line message)."""


def view_slug(view: str) -> str:
    """DNS-label form of a view name, as the chart computes it (``user_sessions`` -> ``user-sessions``)."""
    slug = view.replace("_", "-").lower()
    if not _VIEW_NAME.match(view) or not _DNS_LABEL.match(slug):
        raise KubernetesRunnerError(f"view name {view!r} cannot be turned into a DNS label")
    return slug


def validate_starting(starting: str) -> str:
    """Check a start position: ``earliest`` | ``latest`` | ``ts:<epoch ms>`` | JSON offsets object."""
    if starting in ("earliest", "latest"):
        return starting
    if starting.startswith("ts:") and starting[3:].isdigit():
        return starting
    try:
        offsets = json.loads(starting)
    except ValueError:
        offsets = None
    if isinstance(offsets, dict) and offsets:
        return starting
    raise KubernetesRunnerError(
        f"invalid starting position {starting!r}: expected earliest, latest, ts:<epoch ms> or a JSON offsets object"
    )


def _fill(node: Any, values: dict[str, str]) -> Any:
    """Replace every placeholder in every string (keys included) of a parsed YAML tree, in one pass."""
    if isinstance(node, str):
        return _PLACEHOLDER_RE.sub(lambda m: values[m.group(0)], node)
    if isinstance(node, dict):
        return {_fill(k, values): _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    return node


@dataclass(frozen=True)
class _FallbackStatus:
    """Same fields as ``kappa.control.runners.base.JobStatus``; used only if that module is unavailable."""

    ref: str
    state: str
    detail: str = ""
    metrics_url: str | None = None


def _status(ref: str, state: str, detail: str = "", metrics_url: str | None = None) -> Any:
    try:  # the platform's runner interface, when present (kept optional: this module is self-contained)
        from kappa.control.runners.base import JobStatus
    except ImportError:  # pragma: no cover - only without the base module
        return _FallbackStatus(ref, state, detail, metrics_url)
    return JobStatus(ref=ref, state=state, detail=detail, metrics_url=metrics_url)  # type: ignore[arg-type]


def _get(obj: dict[str, Any], snake: str, camel: str) -> Any:
    """A field of an API object as a dict: the client's ``to_dict()`` spells it in snake case, raw JSON in camel."""
    value = obj.get(snake)
    return obj.get(camel) if value is None else value


def _metrics_url(pods: list[dict[str, Any]], port_name: str) -> str | None:
    """``http://<pod IP>:<container port named port_name>/metrics`` of the first Ready pod not being deleted
    (None while no pod is Ready, or none declares that port)."""
    for pod in pods:
        meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        if _get(meta, "deletion_timestamp", "deletionTimestamp"):
            continue
        ip = _get(st, "pod_ip", "podIP")
        ready = any(c.get("type") == "Ready" and str(c.get("status")) == "True" for c in st.get("conditions") or [])
        if not ip or not ready:
            continue
        for container in spec.get("containers") or []:
            for port in container.get("ports") or []:
                number = _get(port, "container_port", "containerPort")
                if port.get("name") == port_name and number:
                    host = f"[{ip}]" if ":" in str(ip) else ip
                    return f"http://{host}:{int(number)}/metrics"
    return None


class KubernetesRunner:
    """Starts, stops and reports view-version drivers as Deployments in one namespace.

    Args:
        deployment_template: text of the chart's ``deployment.yaml`` template (with placeholders).
        service_template: text of ``service.yaml`` (driver Service, Spark-on-Kubernetes mode) or None.
        namespace: namespace to work in; defaults to ``$KAPPA_K8S_NAMESPACE``, the pod's namespace, or the
            namespace rendered into the template.
        apps_api / core_api / batch_api: ``kubernetes.client.AppsV1Api`` / ``CoreV1Api`` / ``BatchV1Api``
            instances (tests inject fakes);
            created lazily from the in-cluster (else kubeconfig) configuration otherwise.
        state_configmap: the view-state ConfigMap starts and stops are recorded in (None: not recorded).
        grouped_deployment: the chart's grouped driver (``viewJobs.grouping=grouped``) hosting the chart's
            versions, or None.
    """

    name = "kubernetes"

    def __init__(
        self,
        deployment_template: str,
        service_template: str | None = None,
        *,
        namespace: str | None = None,
        apps_api: Any = None,
        core_api: Any = None,
        batch_api: Any = None,
        state_configmap: str | None = None,
        grouped_deployment: str | None = None,
    ) -> None:
        self._deployment_template = self._parse_template(deployment_template, "deployment.yaml", "Deployment")
        self._service_template = (
            self._parse_template(service_template, "service.yaml", "Service") if service_template else None
        )
        self.namespace = (
            namespace
            or self._deployment_template.get("metadata", {}).get("namespace")
            or (_SERVICE_ACCOUNT_NS.read_text().strip() if _SERVICE_ACCOUNT_NS.exists() else "default")
        )
        self._apps = apps_api
        self._core = core_api
        self._batch = batch_api
        self.state_configmap = state_configmap or None
        self.grouped_deployment = grouped_deployment or None

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_dir(cls, template_dir: str | Path | None = None, *, settings: "Settings | None" = None,
                 **kwargs: Any) -> KubernetesRunner:
        """Build from a mounted view-template ConfigMap (default ``KAPPA_VIEW_TEMPLATE_DIR``, else
        :data:`DEFAULT_TEMPLATE_DIR`) in the namespace ``KAPPA_K8S_NAMESPACE`` (when set)."""
        from kappa.config import Settings

        settings = settings or Settings.from_env()
        directory = Path(template_dir or settings.view_template_dir or DEFAULT_TEMPLATE_DIR)
        deployment = directory / "deployment.yaml"
        if not deployment.is_file():
            raise KubernetesRunnerError(
                f"{deployment} not found: mount the chart's <release>-view-template ConfigMap there "
                "or set KAPPA_VIEW_TEMPLATE_DIR"
            )
        service = directory / "service.yaml"
        kwargs.setdefault("namespace", settings.k8s_namespace)
        runner = directory / "runner.json"
        return cls(
            deployment.read_text(encoding="utf-8"),
            service.read_text(encoding="utf-8") if service.is_file() else None,
            **cls._runner_options(runner.read_text(encoding="utf-8") if runner.is_file() else None),
            **kwargs,
        )

    @staticmethod
    def _runner_options(text: str | None) -> dict[str, Any]:
        """``runner.json`` of the view template: where starts/stops are recorded, which driver is grouped."""
        if not text:
            return {}
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise KubernetesRunnerError(f"view template runner.json is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise KubernetesRunnerError("view template runner.json is not a JSON object")
        return {"state_configmap": doc.get("stateConfigMap") or None,
                "grouped_deployment": doc.get("groupedDeployment") or None}

    from_env = from_dir

    @classmethod
    def from_settings(cls, settings: "Settings") -> KubernetesRunner:
        """The runner ``KAPPA_RUNNER=kubernetes`` names (:func:`kappa.control.runners.runner_for`)."""
        return cls.from_dir(settings=settings)

    @classmethod
    def from_configmap(cls, data: dict[str, str], **kwargs: Any) -> KubernetesRunner:
        """Build from the ``data`` of the view-template ConfigMap (e.g. read through the API)."""
        if "deployment.yaml" not in data:
            raise KubernetesRunnerError("view-template ConfigMap has no deployment.yaml key")
        return cls(data["deployment.yaml"], data.get("service.yaml"),
                   **{**cls._runner_options(data.get("runner.json")), **kwargs})

    @staticmethod
    def _parse_template(text: str, what: str, kind: str) -> dict[str, Any]:
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise KubernetesRunnerError(f"view template {what} is not valid YAML: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("kind") != kind:
            raise KubernetesRunnerError(f"view template {what} is not a {kind} manifest")
        if kind == "Deployment" and PLACEHOLDERS["version"] not in json.dumps(doc):
            raise KubernetesRunnerError(f"view template {what} has no {PLACEHOLDERS['version']} placeholder")
        return doc

    def _values(self, view: str, version: int, starting: str) -> dict[str, str]:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise KubernetesRunnerError(f"view version must be a positive integer, got {version!r}")
        return {
            PLACEHOLDERS["view"]: view,
            PLACEHOLDERS["slug"]: view_slug(view),
            PLACEHOLDERS["version"]: str(version),
            PLACEHOLDERS["starting"]: validate_starting(starting),
        }

    @staticmethod
    def _check_names(obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        label = obj["metadata"].get("labels", {}).get("app.kubernetes.io/name", "")
        for what, value in (("name", name), ("app.kubernetes.io/name label", label)):
            if len(value) > 63 or not _DNS_LABEL.match(value):
                raise KubernetesRunnerError(f"{obj['kind']} {what} {value!r} is not a DNS label of at most 63 characters")
        return obj

    def manifest(self, view: str, version: int, starting: str = "latest") -> dict[str, Any]:
        """The Deployment of one view-version driver, exactly as the chart renders it (pure; no API call)."""
        values = self._values(view, version, starting)
        return self._check_names(_fill(copy.deepcopy(self._deployment_template), values))

    def job_manifest(self, view: str, version: int, starting: str = "earliest") -> dict[str, Any]:
        """The bounded-run form: the chart's driver pod template (unchanged but for ``restartPolicy``) in a Job.

        Same name, labels (so the metrics PodMonitor, NetworkPolicies and executor ownership apply) and
        ``kappa.io/starting`` annotation as the Deployment; no Helm ownership annotations, since no chart
        release renders Jobs.
        """
        deployment = self.manifest(view, version, starting)
        metadata = copy.deepcopy(deployment["metadata"])
        annotations = {k: v for k, v in (metadata.get("annotations") or {}).items() if not k.startswith("meta.helm.sh/")}
        metadata["annotations"] = {**annotations, "kappa.io/bounded": "true"}
        template = copy.deepcopy(deployment["spec"]["template"])
        template["spec"]["restartPolicy"] = "OnFailure"
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": metadata,
            "spec": {
                "backoffLimit": JOB_BACKOFF_LIMIT,
                "ttlSecondsAfterFinished": JOB_TTL_SECONDS,
                "template": template,
            },
        }

    def service_manifest(self, view: str, version: int) -> dict[str, Any] | None:
        """The driver's headless Service (Spark-on-Kubernetes mode), or None in Spark local mode."""
        if self._service_template is None:
            return None
        values = self._values(view, version, "latest")
        return self._check_names(_fill(copy.deepcopy(self._service_template), values))

    def deployment_name(self, view: str, version: int) -> str:
        return str(self.manifest(view, version)["metadata"]["name"])

    # ------------------------------------------------------------------------------------------ API
    def _clients(self) -> tuple[Any, Any]:
        if self._apps is None or self._core is None or self._batch is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise KubernetesRunnerError(_INSTALL_HINT) from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:  # KUBECONFIG as it is now (the client reads it once, at its import)
                    config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
                except Exception as exc:
                    raise KubernetesRunnerError(f"no in-cluster or kubeconfig configuration: {exc}") from None
            api = client.ApiClient()
            self._apps = self._apps or client.AppsV1Api(api)
            self._core = self._core or client.CoreV1Api(api)
            self._batch = self._batch or client.BatchV1Api(api)
        return self._apps, self._core

    @staticmethod
    def _http_status(exc: BaseException) -> int | None:
        status = getattr(exc, "status", None)
        return status if isinstance(status, int) else None

    def _call(self, what: str, fn: Any, *args: Any, ignore: tuple[int, ...] = (), **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # kubernetes.client.exceptions.ApiException, urllib3 errors
            status = self._http_status(exc)
            if status in ignore:
                return None
            reason = getattr(exc, "reason", None) or exc.__class__.__name__
            raise KubernetesRunnerError(f"{what} failed: {status or ''} {reason}".replace("  ", " ")) from exc

    def start(
        self,
        spec_or_view: Any,
        version: int | None = None,
        starting: str | None = None,
        *,
        wait: bool = False,
        timeout: float = 600.0,
    ) -> Any:
        """Create the driver (and its Service); a driver that already exists is left alone (no-op).

        Accepts a ``kappa.control.runners.base.JobSpec`` -- its bounded-run options (``--end-ts``,
        ``--max-offsets-per-trigger``) and ``env`` are appended to the template's container, and a bounded spec
        (``end_timestamp_ms``) becomes a Job instead of a Deployment -- or ``(view, version, starting)``.
        With ``wait``, returns once the driver pod is Ready.
        """
        extra_args: list[str] = []
        extra_env: dict[str, str] = {}
        bounded = False
        if isinstance(spec_or_view, str):
            if version is None:
                raise KubernetesRunnerError("start(view, version, starting): version is required")
            view, starting = spec_or_view, starting or "latest"
        else:
            spec = spec_or_view
            view, version, starting = spec.view, spec.version, starting or spec.starting
            bounded = getattr(spec, "end_timestamp_ms", None) is not None
            extra_args = [str(a) for a in spec.run_options()]  # the template carries view, version, start, port
            extra_env = {str(k): str(v) for k, v in (getattr(spec, "env", None) or {}).items()}
        version = int(version)  # type: ignore[arg-type]
        body = self.job_manifest(view, version, starting) if bounded else self.manifest(view, version, starting)
        container = body["spec"]["template"]["spec"]["containers"][0]
        container["args"] = list(container["args"]) + extra_args
        if extra_env:  # sorted, as the chart renders the recorded env (kappa.runningViews)
            container["env"] = list(container.get("env", [])) + [
                {"name": k, "value": v} for k, v in sorted(extra_env.items())]
        apps, core = self._clients()
        name = body["metadata"]["name"]
        if self._read_deployment(name) is None and self._read_job(name) is None:
            service = self.service_manifest(view, version)
            if service is not None:
                self._call(f"create service/{service['metadata']['name']}", core.create_namespaced_service,
                           self.namespace, service, ignore=(409,))
            if bounded:
                self._call(f"create job/{name}", self._batch.create_namespaced_job, self.namespace, body,
                           ignore=(409,))
            else:
                self._call(f"create deployment/{name}", apps.create_namespaced_deployment, self.namespace, body,
                           ignore=(409,))
        if not bounded:  # a Job ends by itself: nothing for a later upgrade to keep
            self._record(view, version, {"state": "running", "starting": starting, "args": extra_args,
                                         "env": dict(sorted(extra_env.items()))})
        if wait:
            return self.wait(view, version, ready=True, timeout=timeout)
        return self.status(view, version)

    def _read_deployment(self, name: str) -> Any:
        apps, _core = self._clients()
        return self._call(f"read deployment/{name}", apps.read_namespaced_deployment, name, self.namespace,
                          ignore=(404,))

    def _read_job(self, name: str) -> Any:
        self._clients()
        return self._call(f"read job/{name}", self._batch.read_namespaced_job, name, self.namespace, ignore=(404,))

    def stop(self, view: str, version: int, *, wait: bool = False, timeout: float = 300.0) -> Any:
        """Delete the driver's Deployment or Job (foreground: its pod goes first) and its Service.

        Recorded first in the view-state ConfigMap: the next ``helm upgrade`` does not start the version again, and
        a version hosted by the grouped driver is stopped there (at its next refresh of the mounted record).
        """
        name = self.deployment_name(view, version)
        apps, core = self._clients()
        self._record(view, version, {"state": "stopped"})
        self._call(f"delete deployment/{name}", apps.delete_namespaced_deployment, name, self.namespace,
                   propagation_policy="Foreground", ignore=(404,))
        self._call(f"delete job/{name}", self._batch.delete_namespaced_job, name, self.namespace,
                   propagation_policy="Foreground", ignore=(404,))
        service = self.service_manifest(view, version)
        if service is not None:
            self._call(f"delete service/{service['metadata']['name']}", core.delete_namespaced_service,
                       service["metadata"]["name"], self.namespace, ignore=(404,))
        if wait:
            return self.wait(view, version, ready=False, timeout=timeout)
        return self.status(view, version)

    def status(self, view: str, version: int) -> Any:
        """``running`` while the driver's Deployment (or unfinished Job) exists -- the detail says whether its
        pod is Ready --, ``finished`` once a bounded Job completed, ``failed`` when the driver crash-loops, the
        rollout exceeded its deadline or the Job ran out of retries, ``stopped`` otherwise. A running driver's
        status carries the metrics URL of its Ready pod (None until a pod is Ready)."""
        manifest = self.manifest(view, version)
        name = manifest["metadata"]["name"]
        ref = view_ref(view, version)
        _apps, core = self._clients()
        dep = self._read_deployment(name)
        kind = "deployment"
        if dep is None:
            dep = self._read_job(name)
            kind = "job"
            if dep is None:
                return self._hosted_status(view, version)
        dep = dep.to_dict() if hasattr(dep, "to_dict") else dep
        meta, st = dep.get("metadata") or {}, dep.get("status") or {}
        if meta.get("deletion_timestamp") or meta.get("deletionTimestamp"):
            return _status(ref, "stopped", f"{kind}/{name} is being deleted")
        for cond in st.get("conditions") or []:
            if str(cond.get("status", "True")) != "True":
                continue
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                return _status(ref, "failed", f"deployment/{name}: {cond.get('message') or 'progress deadline exceeded'}")
            if kind == "job" and cond.get("type") == "Complete":
                return _status(ref, "finished", f"job/{name}: bounded run completed")
            if kind == "job" and cond.get("type") == "Failed":
                return _status(ref, "failed", f"job/{name}: {cond.get('reason') or 'failed'} "
                                              f"{cond.get('message') or ''}".strip())
        selector = ",".join(f"{k}={v}" for k, v in manifest["spec"]["selector"]["matchLabels"].items())
        pods = self._call(f"list pods of {kind}/{name}", core.list_namespaced_pod, self.namespace,
                          label_selector=selector)
        pods = pods.to_dict() if hasattr(pods, "to_dict") else (pods or {})
        for pod in pods.get("items") or []:
            for cs in (pod.get("status") or {}).get("container_statuses") or []:
                waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
                restarts = cs.get("restart_count", cs.get("restartCount")) or 0
                if waiting in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"):
                    return _status(ref, "failed", f"{kind}/{name}: {waiting} (restarts {restarts})")
                # the driver restarts a failed query itself (KAPPA_HOST_MAX_RESTARTS times) before it exits: a live
                # driver that exited with an error twice is crash-looping, whether or not a look falls in its
                # back-off (a bounded Job's pod has JOB_BACKOFF_LIMIT retries)
                ended = ((cs.get("last_state") or cs.get("lastState") or {}).get("terminated") or {})
                code = ended.get("exit_code", ended.get("exitCode"))
                if kind == "deployment" and restarts >= CRASH_LOOP_RESTARTS and code not in (None, 0):
                    return _status(ref, "failed", f"{kind}/{name}: restarted {restarts} times, last exit code {code} "
                                                  f"({ended.get('reason') or 'Error'})")
        ready = (st.get("ready_replicas", st.get("readyReplicas")) if kind == "deployment" else st.get("ready")) or 0
        return _status(ref, "running", f"{kind}/{name} {'ready' if ready else 'starting (0/1 ready)'}",
                       _metrics_url(pods.get("items") or [], "metrics"))

    # ------------------------------------------------------------------------------------------ recorded state
    def recorded(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The view-state record (``{view: {version: entry}}``); empty when none is configured or it is empty."""
        if not self.state_configmap:
            return {}
        _apps, core = self._clients()
        cm = self._call(f"read configmap/{self.state_configmap}", core.read_namespaced_config_map,
                        self.state_configmap, self.namespace, ignore=(404,))
        return self._parse_record(cm)[0]

    def _parse_record(self, cm: Any) -> tuple[dict[str, Any], str | None]:
        if cm is None:
            return {}, None
        data = (cm.data if hasattr(cm, "data") else (cm or {}).get("data")) or {}
        meta = cm.metadata if hasattr(cm, "metadata") else (cm or {}).get("metadata") or {}
        rv = getattr(meta, "resource_version", None) if not isinstance(meta, dict) else meta.get("resourceVersion")
        try:
            doc = json.loads(data.get("views.json") or "{}")
        except ValueError as exc:
            raise KubernetesRunnerError(f"configmap/{self.state_configmap}: views.json is not JSON ({exc}); fix or "
                                        "empty it ({}) before starting or stopping drivers") from None
        return (doc if isinstance(doc, dict) else {}), rv

    def _record(self, view: str, version: int, entry: dict[str, Any], *, attempts: int = 8) -> None:
        """Set ``views.json[view][version]`` (read, modify, replace with the read ``resourceVersion``: a concurrent
        writer makes the replace fail with 409 and it is redone on the new content)."""
        if not self.state_configmap:
            return
        _apps, core = self._clients()
        entry = {**entry, "by": "kubernetes-runner", "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        for attempt in range(attempts):
            cm = self._call(f"read configmap/{self.state_configmap}", core.read_namespaced_config_map,
                            self.state_configmap, self.namespace, ignore=(404,))
            if cm is None:
                raise KubernetesRunnerError(
                    f"configmap/{self.state_configmap} not found: the chart creates it (helm upgrade the release); "
                    f"without it the next upgrade would undo what this runner starts and stops")
            doc, rv = self._parse_record(cm)
            doc.setdefault(view, {})[str(version)] = entry
            body = {"metadata": {"name": self.state_configmap, "resourceVersion": rv},
                    "data": {"views.json": json.dumps(doc, indent=1, sort_keys=True)}}
            try:
                core.patch_namespaced_config_map(self.state_configmap, self.namespace, body)
                return
            except Exception as exc:  # noqa: BLE001 - a conflict is retried, anything else reported
                if self._http_status(exc) != 409 or attempt == attempts - 1:
                    reason = getattr(exc, "reason", None) or exc.__class__.__name__
                    raise KubernetesRunnerError(f"record {view_ref(view, version)} in configmap/"
                                                f"{self.state_configmap} failed: {self._http_status(exc) or ''} "
                                                f"{reason}".replace("  ", " ")) from exc
                time.sleep(0.2 * (attempt + 1))

    def _hosted_status(self, view: str, version: int) -> Any:
        """Status of a version with no Deployment or Job of its own: hosted by the grouped driver, or stopped."""
        ref = view_ref(view, version)
        if not self.grouped_deployment:
            return _status(ref, "stopped", "no deployment")
        entry = (self.recorded().get(view) or {}).get(str(version))
        host = self._read_deployment(self.grouped_deployment)
        host = host.to_dict() if hasattr(host, "to_dict") else host
        hosted = ref in ((((host or {}).get("metadata") or {}).get("annotations") or {}).get("kappa.io/views") or ""
                         ).split(",")
        if entry is not None and entry.get("state") == "stopped":
            detail = f"stopped by the runner at {entry.get('at', '?')}"
            if hosted:
                detail += f" (deployment/{self.grouped_deployment} stops it at its next refresh of the record)"
            return _status(ref, "stopped", detail)
        if entry is not None:  # started by the runner, its Deployment gone since
            return _status(ref, "stopped", f"no deployment (recorded {entry.get('state')} at {entry.get('at', '?')})")
        if not hosted:
            return _status(ref, "stopped", "no deployment")
        ready = ((host or {}).get("status") or {}).get("ready_replicas") or 0
        return _status(ref, "running", f"hosted by deployment/{self.grouped_deployment} "
                                       f"{'ready' if ready else 'starting (0/1 ready)'}",
                       self._hosted_metrics_url(host or {}, ref))

    def _hosted_metrics_url(self, host: dict[str, Any], ref: str) -> str | None:
        """Metrics URL of ``ref`` in the grouped driver: container port ``m-<i>`` of its Ready pod, ``i`` being the
        version's place in the driver's ``kappa.io/views`` annotation (the chart's order)."""
        refs = (((host.get("metadata") or {}).get("annotations") or {}).get("kappa.io/views") or "").split(",")
        selector = ((host.get("spec") or {}).get("selector") or {}).get("match_labels") or \
            ((host.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if ref not in refs or not selector:
            return None
        _apps, core = self._clients()
        pods = self._call(f"list pods of deployment/{self.grouped_deployment}", core.list_namespaced_pod,
                          self.namespace, label_selector=",".join(f"{k}={v}" for k, v in selector.items()))
        pods = pods.to_dict() if hasattr(pods, "to_dict") else (pods or {})
        return _metrics_url(pods.get("items") or [], f"m-{refs.index(ref)}")

    def wait(self, view: str, version: int, *, ready: bool = True, timeout: float = 600.0, poll: float = 5.0) -> Any:
        """Poll until the driver is Ready (``ready=True``) or gone (``ready=False``); raise on timeout/failure."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.status(view, version)
            if ready and current.state == "running" and current.detail.endswith(" ready"):
                return current
            if ready and current.state == "finished":
                return current
            if not ready and current.state == "stopped" and "being deleted" not in current.detail:
                return current
            if ready and current.state == "failed":
                raise KubernetesRunnerError(f"{view_ref(view, version)} failed: {current.detail}")
            if time.monotonic() >= deadline:
                raise KubernetesRunnerError(
                    f"{view_ref(view, version)} not {'ready' if ready else 'stopped'} after {timeout:.0f}s "
                    f"({current.state}: {current.detail})"
                )
            time.sleep(poll)
