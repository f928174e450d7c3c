{{/*
The view-workload templates: ONE definition used twice.

  1. views/deployments.yaml renders it for every running view version (kappa/platform.yaml
     default_version, or .Values.views.<view>.versions) when viewJobs.grouping=perView; with
     viewJobs.grouping=grouped it renders "kappa.view.groupedDeployment" instead, one driver hosting them
     all, built from the same "kappa.view.driverDeployment" pod spec.
  2. views/configmap-view-template.yaml renders it once with placeholders
       __KAPPA_VIEW__        view name as declared (campaign_window_counts)
       __KAPPA_VIEW_SLUG__   its DNS-label form (campaign-window-counts)
       __KAPPA_VERSION__     view version (integer)
       __KAPPA_STARTING__    starting position (earliest | latest | JSON offsets | ts:<epoch ms>)
     into a ConfigMap that the in-cluster Kubernetes runner (kappa/control/runners/kubernetes.py) reads, so a
     replay started from Airflow creates exactly the object the chart would have created.

Arguments (dict): root ($), view, slug, version (string), starting.
*/}}

{{- define "kappa.view.workload" -}}
{{- printf "view-%s-v%s" .slug .version -}}
{{- end -}}

{{/*
One view-driver Deployment per view version (viewJobs.grouping=perView, and every driver the Kubernetes
runner starts, in both modes). Arguments (dict): root ($), view, slug, version (string), starting.
*/}}
{{- define "kappa.view.deployment" -}}
{{- $root := .root -}}
{{- $v := $root.Values.viewJobs -}}
{{- $workload := include "kappa.view.workload" . -}}
{{- $name := include "kappa.workloadName" (list $root $workload) -}}
{{- $conf := list -}}
{{- if eq $v.spark.mode "kubernetes" -}}
{{- $conf = list "spark.kubernetes.driver.pod.name=$(POD_NAME)"
      (printf "spark.driver.host=%s-driver.%s.svc.%s" $name $root.Release.Namespace $root.Values.clusterDomain)
      (printf "spark.kubernetes.executor.podNamePrefix=%s" $name)
      (printf "spark.kubernetes.executor.label.kappa.io/view=%s" .view)
      (printf "spark.kubernetes.executor.label.kappa.io/view-version=%s" .version) -}}
{{- end -}}
{{- /* the metrics endpoint comes up with the driver process: it is the driver's health */ -}}
{{- $probe := dict "httpGet" (dict "path" "/metrics" "port" "metrics") -}}
{{- include "kappa.view.driverDeployment" (dict
      "root" $root
      "workload" $workload
      "labels" (dict "kappa.io/view" .view "kappa.io/view-version" .version)
      "annotations" (dict "kappa.io/starting" .starting)
      "args" (concat (list "kappa" "view" "run" .view "--version" .version "--starting" .starting "--metrics-port" (toString $v.metricsPort)) (.extraArgs | default (list)))
      "extraEnv" (.extraEnv | default (dict))
      "ports" (list (dict "name" "metrics" "containerPort" $v.metricsPort "protocol" "TCP"))
      "probes" (dict "startup" $probe "readiness" $probe "liveness" $probe)
      "resources" $v.resources
      "sparkConf" $conf) -}}
{{- end -}}

{{/*
viewJobs.grouping=grouped: ONE Deployment (<fullname>-views) running the chart's view versions
("kappa.hostedViews") in one Spark application (kappa/runtime/host.py, `kappa host run`): each view version keeps its
own streaming query, checkpoint, driver lock and FAIR pool, and the i-th one serves /metrics on
viewJobs.metricsPort + i (container port m-<i>). Rendered only when at least one view version runs.
Spark-on-Kubernetes mode is refused for it (templates/_validate.tpl).
*/}}
{{- define "kappa.view.hostedPortName" -}}
{{- printf "m-%d" (int .) -}}
{{- end -}}

{{- define "kappa.view.groupedDeployment" -}}
{{- $v := .Values.viewJobs -}}
{{- $running := include "kappa.hostedViews" . | fromJsonArray -}}
{{- $args := list "kappa" "host" "run" -}}
{{- $ports := list -}}
{{- $numbers := list -}}
{{- $refs := list -}}
{{- range $i, $rv := $running -}}
{{- $ref := printf "%s@v%s" $rv.view $rv.version -}}
{{- $args = concat $args (list "--view" $ref "--starting" $rv.starting) -}}
{{- $ports = append $ports (dict "name" (include "kappa.view.hostedPortName" $i) "containerPort" (add $v.metricsPort $i) "protocol" "TCP") -}}
{{- $numbers = append $numbers (printf "%s=%d" $ref (int (add $v.metricsPort $i))) -}}
{{- $refs = append $refs $ref -}}
{{- end -}}
{{- $args = concat $args (list "--metrics-port" (toString $v.metricsPort) "--driver-memory" $v.groupedDriverMemory "--handed-over" "/etc/kappa/view-state/views.json") -}}
{{- /*
Probes. A per-view driver is probed with GET /metrics on its one metrics port. The host has one such
endpoint per view version, and a view whose query fails is stopped ALONE (its endpoint closes, the other
views go on), so probing a single port would either miss failures or, as liveness, restart every healthy
view because one failed. The same GET /metrics is therefore made on every view's port (a small Python
check; the image has no curl). A version the Kubernetes runner took over (recorded in the mounted view-state
file: a promote stopped it, a rollback runs it in a Deployment of its own) is no longer the host's, and its port
is not checked. A version waiting for its topic to be created answers (kappa_waiting_for_topic says so): the
topics Job is a post-install hook, run once the pods are Ready.
  readiness        every view version the host runs answers: the pod turns NotReady while one of them is down
  startup/liveness at least one answers: the host process is alive; it is restarted only when no view
                   is left running (nothing to protect), or when the process hangs
*/ -}}
{{- $check := list "python" "-c" (include "kappa.view.metricsCheck" .) "/etc/kappa/view-state/views.json" -}}
{{- $any := dict "exec" (dict "command" (concat $check (list "any") $numbers)) -}}
{{- $all := dict "exec" (dict "command" (concat $check (list "all") $numbers)) -}}
{{- include "kappa.view.driverDeployment" (dict
      "root" .
      "workload" "views"
      "labels" (dict)
      "annotations" (dict "kappa.io/views" (join "," $refs))
      "args" $args
      "ports" $ports
      "probes" (dict "startup" $any "readiness" $all "liveness" $any)
      "resources" $v.groupedResources
      "sparkConf" (list)
      "volumes" (list (dict "name" "view-state" "configMap" (dict "name" (include "kappa.workloadName" (list . "view-state")) "optional" true)))
      "volumeMounts" (list (dict "name" "view-state" "mountPath" "/etc/kappa/view-state" "readOnly" true))) -}}
{{- end -}}

{{/* `python -c` body of the grouped driver's probes: argv = the view-state file, all|any, then <view@vN>=<port>
for each version; versions recorded in the view-state file are skipped (handed over), and a host with none left
passes. */}}
{{- define "kappa.view.metricsCheck" -}}
import http.client, json, sys
from concurrent.futures import ThreadPoolExecutor
def up(port):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=3)
        conn.request("GET", "/metrics")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
try:
    with open(sys.argv[1]) as fh:
        state = json.load(fh)
    taken = {f"{v}@v{n}" for v, vs in state.items() for n in vs if str(n).isdigit()}
except (OSError, ValueError, AttributeError, TypeError):
    taken = set()
ports = [t.rsplit("=", 1)[1] for t in sys.argv[3:] if t.rsplit("=", 1)[0] not in taken]
with ThreadPoolExecutor(max(1, len(ports))) as pool:
    ok = list(pool.map(up, ports))
sys.exit(0 if (all(ok) if sys.argv[2] == "all" else any(ok) or not ports) else 1)
{{- end -}}

{{/*
Container ports serving /metrics on view-driver pods: `metrics` (per-view drivers, and the drivers the
Kubernetes runner starts in both modes) and, in grouped mode, m-<i> of the grouped driver. JSON list;
used by the PodMonitor and the drivers' NetworkPolicy.
*/}}
{{- define "kappa.view.metricsPortNames" -}}
{{- $names := list "metrics" -}}
{{- if eq .Values.viewJobs.grouping "grouped" -}}
{{- range $i, $_ := include "kappa.hostedViews" . | fromJsonArray -}}
{{- $names = append $names (include "kappa.view.hostedPortName" $i) -}}
{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/*
The driver Deployment both modes share: pod spec, image, env, volumes, security context, lake affinity.
Arguments (dict): root ($), workload (object-name suffix), labels / annotations (extra metadata, dicts),
args (list), ports (metrics container ports), probes (dict startup/readiness/liveness -> probe action),
resources, sparkConf (per-driver Spark settings for PYSPARK_SUBMIT_ARGS; Spark-on-Kubernetes mode); optional:
extraEnv (dict name -> value, appended last), volumes / volumeMounts (lists, appended).
*/}}
{{- define "kappa.view.driverDeployment" -}}
{{- $root := .root -}}
{{- $workload := .workload -}}
{{- $name := include "kappa.workloadName" (list $root $workload) -}}
{{- $k8s := eq $root.Values.viewJobs.spark.mode "kubernetes" -}}
{{- $v := $root.Values.viewJobs -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kappa.labels" (list $root $workload "view") | nindent 4 }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Helm ownership metadata is part of the template so that a driver started by the Kubernetes
    # runner is adopted (not refused) when the same version is later pinned in values.
    meta.helm.sh/release-name: {{ $root.Release.Name }}
    meta.helm.sh/release-namespace: {{ $root.Release.Namespace }}
    {{- toYaml .annotations | nindent 4 }}
spec:
  # Exactly one driver per view version: the Spark checkpoint and the Delta txnAppId/txnVersion
  # pair belong to a single writer, so never more than one replica ...
  replicas: 1
  revisionHistoryLimit: 3
  # ... and never a surge pod during a rollout: Recreate stops the old driver before starting the new one.
  strategy:
    type: Recreate
  selector:
    matchLabels:
      {{- include "kappa.selectorLabels" (list $root $workload) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kappa.labels" (list $root $workload "view") | nindent 8 }}
        {{- with .labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- if include "kappa.lake.colocate" $root }}
        kappa.io/lake-claim: {{ include "kappa.lake.claimName" $root }}
        {{- end }}
      annotations:
        kubectl.kubernetes.io/default-container: driver
        checksum/spark-conf: {{ include (print $root.Template.BasePath "/views/configmap-spark.yaml") $root | sha256sum }}
        checksum/platform-env: {{ include (print $root.Template.BasePath "/views/configmap-platform-env.yaml") $root | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "kappa.viewJobs.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with include "kappa.imagePullSecrets" $root }}{{ . | trim | nindent 6 }}{{- end }}
      {{- include "kappa.podSecurityContext" (dict "uid" 10001 "gid" 10001 "fsGroup" 10001) | nindent 6 }}
      {{- with include "kappa.lake.affinity" (list $root $v.affinity) }}{{ . | trim | nindent 6 }}{{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: driver
          image: {{ include "kappa.image" (dict "image" $root.Values.image "root" $root) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: HOME
              value: /tmp
            - name: SPARK_CONF_DIR
              value: /opt/kappa/spark-conf
            - name: KAPPA_METRICS_PORT
              value: {{ $v.metricsPort | quote }}
            {{- with .sparkConf }}
            # per-driver Spark settings (the shared ones are in spark-defaults.conf): executors reach
            # this driver through its headless Service and are owned by (garbage-collected with) its pod
            - name: PYSPARK_SUBMIT_ARGS
              value: >-
                {{- range . }}
                --conf {{ . }}
                {{- end }}
                pyspark-shell
            {{- end }}
            {{- with include "kappa.platformEnv" $root }}{{ . | trim | nindent 12 }}{{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- /* what the Kubernetes runner added when it started this version (kappa.runningViews) */ -}}
            {{- range $k, $val := .extraEnv }}
            - name: {{ $k }}
              value: {{ $val | toString | quote }}
            {{- end }}
          envFrom:
            {{- include "kappa.platformEnvFrom" $root | nindent 12 }}
          ports:
            {{- toYaml .ports | nindent 12 }}
            - name: spark-ui
              containerPort: 4040
              protocol: TCP
            {{- if $k8s }}
            - name: driver-rpc
              containerPort: {{ $v.spark.driverPort }}
              protocol: TCP
            - name: blockmanager
              containerPort: {{ $v.spark.blockManagerPort }}
              protocol: TCP
            {{- end }}
          # Spark start-up (JVM, catalog, first batch planning) can take minutes, hence a startup probe
          # before liveness applies
          startupProbe:
            {{- toYaml (merge (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" $v.startupProbeFailureThreshold) .probes.startup) | nindent 12 }}
          readinessProbe:
            {{- toYaml (merge (dict "periodSeconds" 15 "timeoutSeconds" 5 "failureThreshold" 3) .probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- toYaml (merge (dict "periodSeconds" 30 "timeoutSeconds" 10 "failureThreshold" 4) .probes.liveness) | nindent 12 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          {{- include "kappa.containerSecurityContext" $root | nindent 10 }}
          volumeMounts:
            {{- include "kappa.platformVolumeMounts" $root | nindent 12 }}
            - name: spark-conf
              mountPath: /opt/kappa/spark-conf
              readOnly: true
            {{- if $k8s }}
            {{- include "kappa.apiAccessVolumeMount" $root | nindent 12 }}
            {{- end }}
            {{- with .volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "kappa.platformVolumes" (list $root $v.tmpSizeLimit) | nindent 8 }}
        - name: spark-conf
          configMap:
            name: {{ include "kappa.workloadName" (list $root "spark-conf") }}
        {{- if $k8s }}
        {{- include "kappa.apiAccessVolume" $root | nindent 8 }}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* Headless Service through which Spark executors reach a view driver (Spark-on-Kubernetes client mode). */}}
{{- define "kappa.view.driverService" -}}
{{- $root := .root -}}
{{- $workload := include "kappa.view.workload" . -}}
{{- $name := include "kappa.workloadName" (list $root $workload) -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}-driver
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kappa.labels" (list $root $workload "view") | nindent 4 }}
    kappa.io/view: {{ .view | quote }}
    kappa.io/view-version: {{ .version | quote }}
  annotations:
    meta.helm.sh/release-name: {{ $root.Release.Name }}
    meta.helm.sh/release-namespace: {{ $root.Release.Namespace }}
spec:
  clusterIP: None
  # executors register while the driver pod is still starting (not yet Ready)
  publishNotReadyAddresses: true
  selector:
    {{- include "kappa.selectorLabels" (list $root $workload) | nindent 4 }}
  ports:
    - name: driver-rpc
      port: {{ $root.Values.viewJobs.spark.driverPort }}
      targetPort: driver-rpc
      protocol: TCP
    - name: blockmanager
      port: {{ $root.Values.viewJobs.spark.blockManagerPort }}
      targetPort: blockmanager
      protocol: TCP
{{- end -}}

{{/* ---------------------------------------------------------------- lake co-location (RWO) */}}

{{- define "kappa.lake.colocate" -}}
{{- if and (eq .Values.lake.type "pvc") (eq .Values.lake.persistence.accessMode "ReadWriteOnce") .Values.lake.persistence.colocatePods -}}true{{- end -}}
{{- end -}}

{{/*
A ReadWriteOnce lake volume attaches to one node: every pod mounting it is pinned next to the others
(required pod affinity on the kappa.io/lake-claim label; the first pod matches itself and may go
anywhere). Merged with a user-supplied affinity (its nodeAffinity / podAntiAffinity are kept).
Usage: include "kappa.lake.affinity" (list $ <user affinity map>)
*/}}
{{- define "kappa.lake.affinity" -}}
{{- $root := index . 0 -}}
{{- $user := index . 1 | default dict -}}
{{- $aff := deepCopy $user -}}
{{- if include "kappa.lake.colocate" $root -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (dict "kappa.io/lake-claim" (include "kappa.lake.claimName" $root))) -}}
{{- $pa := get $aff "podAffinity" | default dict -}}
{{- $req := get $pa "requiredDuringSchedulingIgnoredDuringExecution" | default list -}}
{{- $_ := set $pa "requiredDuringSchedulingIgnoredDuringExecution" (append $req $term) -}}
{{- $_ := set $aff "podAffinity" $pa -}}
{{- end -}}
{{- if $aff }}
affinity:
  {{- toYaml $aff | nindent 2 }}
{{- end -}}
{{- end -}}
