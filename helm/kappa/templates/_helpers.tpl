{{/*
Naming and labelling conventions of the chart
=============================================

Every object carries the Bitnami-style labels of "kappa.labels":

  app.kubernetes.io/name        <chart name>-<workload>   e.g. kappa-kafka, kappa-view-user-sessions-v1
  app.kubernetes.io/instance    the Helm release name
  app.kubernetes.io/version     the chart appVersion
  app.kubernetes.io/managed-by  Helm
  app.kubernetes.io/component   kafka | view | topics | airflow-scheduler | ...   (the kind of workload)
  app.kubernetes.io/part-of     <chart name>  (every pod of the platform; NetworkPolicies key on it)
  helm.sh/chart                 <chart>-<chart version>

Selectors (Deployment/StatefulSet .spec.selector, Service .spec.selector, PodDisruptionBudget) use ONLY
app.kubernetes.io/name + app.kubernetes.io/instance ("kappa.selectorLabels"). To keep these two labels
unique per workload, the workload identity is part of app.kubernetes.io/name: each view version's driver
is its own application name ("kappa-view-<view>-v<version>"), the brokers are "kappa-kafka", the Airflow
scheduler is "kappa-airflow-scheduler", and so on. No two workloads of a release therefore share a
selector, no component label is needed in matchLabels, and the selectors never change across upgrades
(they contain neither the chart version nor the app version, which are immutable-field traps).
*/}}

{{- define "kappa.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kappa.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kappa.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Name of a workload's objects: <fullname>-<workload>. Usage: include "kappa.workloadName" (list $ "kafka")
Fails instead of truncating: a truncated name could collide with another workload's.
*/}}
{{- define "kappa.workloadName" -}}
{{- $root := index . 0 -}}
{{- $n := printf "%s-%s" (include "kappa.fullname" $root) (index . 1) -}}
{{- if gt (len $n) 63 -}}
{{- fail (printf "object name %q is longer than 63 characters; shorten the release name or set fullnameOverride" $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/*
Selector labels: ONLY app.kubernetes.io/name + app.kubernetes.io/instance (see the header comment).
Usage: include "kappa.selectorLabels" (list $ "kafka")
*/}}
{{- define "kappa.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $n := printf "%s-%s" (include "kappa.name" $root) (index . 1) -}}
{{- if gt (len $n) 63 -}}
{{- fail (printf "label value app.kubernetes.io/name=%q is longer than 63 characters" $n) -}}
{{- end -}}
app.kubernetes.io/name: {{ $n }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- end -}}

{{/*
All labels. Usage: include "kappa.labels" (list $ "<workload>" "<component>")
*/}}
{{- define "kappa.labels" -}}
{{- $root := index . 0 -}}
{{ include "kappa.selectorLabels" (list $root (index . 1)) }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/component: {{ index . 2 }}
app.kubernetes.io/part-of: {{ include "kappa.name" $root }}
helm.sh/chart: {{ include "kappa.chart" $root }}
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels shared by every pod of the release, used as NetworkPolicy peers ("kappa workloads"). */}}
{{- define "kappa.platformPeerLabels" -}}
app.kubernetes.io/part-of: {{ include "kappa.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Image reference. Usage: include "kappa.image" (dict "image" .Values.image "root" $)
tag defaults to the chart appVersion; a digest wins over the tag.
*/}}
{{- define "kappa.image" -}}
{{- $img := .image -}}
{{- $repo := $img.repository -}}
{{- if $img.registry -}}{{- $repo = printf "%s/%s" $img.registry $img.repository -}}{{- end -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $repo $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .root.Chart.AppVersion $img.tag | toString) -}}
{{- end -}}
{{- end -}}

{{- define "kappa.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Restricted Pod Security Standard: pod- and container-level security contexts.
Usage: include "kappa.podSecurityContext" (dict "uid" 10001 "gid" 10001 "fsGroup" 10001)
*/}}
{{- define "kappa.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .uid }}
  runAsGroup: {{ .gid }}
  fsGroup: {{ .fsGroup }}
  fsGroupChangePolicy: OnRootMismatch
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "kappa.containerSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  privileged: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/*
Explicit service-account token mount for the pods that talk to the Kubernetes API (Spark-on-K8s
drivers, Airflow with the Kubernetes runner). Every pod sets automountServiceAccountToken: false;
these pods mount the same projected volume the kubelet would, with a bounded token lifetime, so the
token is present exactly where it is needed.
*/}}
{{- define "kappa.apiAccessVolume" -}}
- name: kube-api-access
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end -}}

{{- define "kappa.apiAccessVolumeMount" -}}
- name: kube-api-access
  mountPath: /var/run/secrets/kubernetes.io/serviceaccount
  readOnly: true
{{- end -}}

{{/* ---------------------------------------------------------------- platform.yaml */}}

{{/*
The parsed platform declarations (files/platform.yaml, a symlink to kappa/platform.yaml), as JSON.
Usage: $platform := include "kappa.platform" . | fromJson
*/}}
{{- define "kappa.platform" -}}
{{- $raw := .Files.Get "files/platform.yaml" -}}
{{- if not $raw -}}
{{- fail "files/platform.yaml is missing or empty: it must be a symlink to ../../../kappa/platform.yaml" -}}
{{- end -}}
{{- $p := fromYaml $raw -}}
{{- if hasKey $p "Error" -}}
{{- fail (printf "files/platform.yaml does not parse: %s" (get $p "Error")) -}}
{{- end -}}
{{- if or (not (kindIs "map" (get $p "topics"))) (not (kindIs "map" (get $p "views"))) -}}
{{- fail "files/platform.yaml must declare the maps `topics` and `views`" -}}
{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{/* DNS-label form of a view name: user_sessions -> user-sessions */}}
{{- define "kappa.viewSlug" -}}
{{- $s := . | replace "_" "-" | lower -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $s) -}}
{{- fail (printf "view name %q cannot be turned into a DNS label" .) -}}
{{- end -}}
{{- $s -}}
{{- end -}}

{{/*
What the Kubernetes runner did since the last install/upgrade: the JSON object in the views.json key of the
ConfigMap <fullname>-view-state (views/configmap-view-state.yaml), read back from the cluster with `lookup`.
  {"<view>": {"<version>": {"state": "running", "starting": "earliest", "args": [...], "env": {...}, ...}
              "<version>": {"state": "stopped", ...}}}
A replay's driver is recorded "running" when the runner creates it and "stopped" when a promote, rollback or
`kappa view stop` stops it, so that `helm upgrade` renders what runs instead of what values said at install.
Empty ({}) where nothing was recorded, and under `helm template` (no cluster to read).
*/}}
{{- define "kappa.viewState" -}}
{{- $name := include "kappa.workloadName" (list . "view-state") -}}
{{- $cm := lookup "v1" "ConfigMap" .Release.Namespace $name -}}
{{- $raw := dig "data" "views.json" "" ($cm | default dict) | default "{}" -}}
{{- $state := fromJson $raw -}}
{{- if hasKey $state "Error" -}}
{{- fail (printf "configmap %s: views.json is not a JSON object (%s); fix or delete it: it records which view versions the Kubernetes runner started and stopped" $name (get $state "Error")) -}}
{{- end -}}
{{- toJson $state -}}
{{- end -}}

{{/*
The running view versions: a JSON list of {view, slug, version, starting, owner, args, env}, sorted by view, the
chart's versions first. Per view, the chart runs .Values.views.<view>.versions, else [default_version], starting
from .Values.views.<view>.starting, else .Values.viewJobs.starting (owner "chart"); then the view-state record
("kappa.viewState") wins: a version the runner stopped is not run, a version the runner started runs as the runner
started it (owner "runner": its own Deployment in both groupings, with the runner's extra args and env, so that
the upgrade adopts the runner's object unchanged).
*/}}
{{- define "kappa.runningViews" -}}
{{- $platform := include "kappa.platform" . | fromJson -}}
{{- $state := include "kappa.viewState" . | fromJson -}}
{{- $stateName := include "kappa.workloadName" (list . "view-state") -}}
{{- $out := list -}}
{{- range $view := keys $platform.views | sortAlpha -}}
{{- $decl := get $platform.views $view -}}
{{- $declared := list -}}
{{- range $k, $_ := $decl.versions }}{{- $declared = append $declared (toString $k) -}}{{- end -}}
{{- $override := get $.Values.views $view | default dict -}}
{{- $recorded := get $state $view | default dict -}}
{{- $versions := list (toString $decl.default_version) -}}
{{- if hasKey $override "versions" -}}
{{- $versions = list -}}
{{- range $override.versions }}{{- $versions = append $versions (toString (int .)) -}}{{- end -}}
{{- end -}}
{{- if ne (len $versions) (len (uniq $versions)) -}}
{{- fail (printf "views.%s.versions lists a version twice: one driver per view version" $view) -}}
{{- end -}}
{{- range $v := $versions -}}
{{- if not (has $v $declared) -}}
{{- fail (printf "views.%s.versions: version %s is not declared in kappa/platform.yaml (declared: %s)" $view $v (join ", " $declared)) -}}
{{- end -}}
{{- if not (hasKey $recorded $v) -}}
{{- $out = append $out (dict "view" $view "slug" (include "kappa.viewSlug" $view) "version" $v "starting" (default $.Values.viewJobs.starting $override.starting) "owner" "chart" "args" (list) "env" (dict)) -}}
{{- end -}}
{{- end -}}
{{- range $v := keys $recorded | sortAlpha -}}
{{- $rec := get $recorded $v -}}
{{- if eq (toString $rec.state) "running" -}}
{{- if not (has $v $declared) -}}
{{- fail (printf "%s@v%s runs (started by a replay, recorded in configmap %s) but is not declared in kappa/platform.yaml (declared: %s): stop it first (kappa view stop %s --version %s)" $view $v $stateName (join ", " $declared) $view $v) -}}
{{- end -}}
{{- $out = append $out (dict "view" $view "slug" (include "kappa.viewSlug" $view) "version" $v "starting" (toString $rec.starting | default "latest") "owner" "runner" "args" (default (list) $rec.args) "env" (default (dict) $rec.env)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
The view versions the grouped driver hosts (viewJobs.grouping=grouped): the chart's running versions. A version the
runner started runs in a Deployment of its own, in both groupings. JSON list, as "kappa.runningViews".
*/}}
{{- define "kappa.hostedViews" -}}
{{- $out := list -}}
{{- range include "kappa.runningViews" . | fromJsonArray -}}
{{- if eq .owner "chart" }}{{ $out = append $out . }}{{ end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* ---------------------------------------------------------------- Kafka / lake connection */}}

{{- define "kappa.kafka.bootstrap" -}}
{{- if .Values.kafka.external.enabled -}}
{{- .Values.kafka.external.bootstrapServers -}}
{{- else -}}
{{- printf "%s.%s.svc.%s:9092" (include "kappa.workloadName" (list . "kafka")) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}
{{- end -}}

{{- define "kappa.kafka.securityProtocol" -}}
{{- if .Values.kafka.external.enabled -}}{{ .Values.kafka.external.securityProtocol }}{{- else -}}PLAINTEXT{{- end -}}
{{- end -}}

{{- define "kappa.kafka.usesSasl" -}}
{{- if and .Values.kafka.external.enabled (hasPrefix "SASL_" .Values.kafka.external.securityProtocol) -}}true{{- end -}}
{{- end -}}

{{- define "kappa.kafka.usesTlsCa" -}}
{{- if and .Values.kafka.external.enabled (hasSuffix "SSL" .Values.kafka.external.securityProtocol) .Values.kafka.external.tls.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "kappa.lake.uri" -}}
{{- if eq .Values.lake.type "s3" -}}
{{- .Values.lake.s3.uri -}}
{{- else -}}
{{- .Values.lake.persistence.mountPath -}}
{{- end -}}
{{- end -}}

{{- define "kappa.lake.claimName" -}}
{{- default (include "kappa.workloadName" (list . "lake")) .Values.lake.persistence.existingClaim -}}
{{- end -}}

{{/*
Environment shared by every platform container (view drivers, topic job, Airflow): connection settings
from ConfigMap "<fullname>-platform-env" plus the credentials, each from a Secret reference.
*/}}
{{- define "kappa.platformEnv" -}}
{{- if include "kappa.kafka.usesSasl" . }}
- name: KAPPA_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.external.sasl.existingSecret }}
      key: {{ .Values.kafka.external.sasl.usernameKey }}
- name: KAPPA_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.external.sasl.existingSecret }}
      key: {{ .Values.kafka.external.sasl.passwordKey }}
{{- end }}
{{- include "kappa.lake.credentialsEnv" . }}
{{- end -}}

{{/* The lake's static S3 credentials (lake.s3.existingSecret), each a Secret reference; nothing otherwise. */}}
{{- define "kappa.lake.credentialsEnv" -}}
{{- if and (eq .Values.lake.type "s3") .Values.lake.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.lake.s3.existingSecret }}
      key: {{ .Values.lake.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.lake.s3.existingSecret }}
      key: {{ .Values.lake.s3.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{- define "kappa.platformEnvFrom" -}}
- configMapRef:
    name: {{ include "kappa.workloadName" (list . "platform-env") }}
{{- end -}}

{{/*
Volumes/mounts every platform container needs: /tmp, the lake PVC, the Kafka CA.
Usage: include "kappa.platformVolumes" (list $ "<size limit of /tmp>")
*/}}
{{- define "kappa.platformVolumes" -}}
{{- $root := index . 0 -}}
{{- with $root -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ index $ 1 }}
{{- if eq .Values.lake.type "pvc" }}
- name: lake
  persistentVolumeClaim:
    claimName: {{ include "kappa.lake.claimName" . }}
{{- end }}
{{- if include "kappa.kafka.usesTlsCa" . }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.external.tls.existingSecret }}
    defaultMode: 0444
    items:
      - key: {{ .Values.kafka.external.tls.caKey }}
        path: ca.crt
{{- end }}
{{- end -}}
{{- end -}}

{{- define "kappa.platformVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq .Values.lake.type "pvc" }}
- name: lake
  mountPath: {{ .Values.lake.persistence.mountPath }}
{{- end }}
{{- if include "kappa.kafka.usesTlsCa" . }}
- name: kafka-ca
  mountPath: /etc/kappa/kafka-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* ServiceAccount names */}}
{{- define "kappa.viewJobs.serviceAccountName" -}}
{{- if .Values.viewJobs.serviceAccount.create -}}
{{- default (include "kappa.workloadName" (list . "view")) .Values.viewJobs.serviceAccount.name -}}
{{- else -}}
{{- required "viewJobs.serviceAccount.name is required when viewJobs.serviceAccount.create=false" .Values.viewJobs.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kappa.airflow.serviceAccountName" -}}
{{- if .Values.airflow.serviceAccount.create -}}
{{- default (include "kappa.workloadName" (list . "airflow")) .Values.airflow.serviceAccount.name -}}
{{- else -}}
{{- required "airflow.serviceAccount.name is required when airflow.serviceAccount.create=false" .Values.airflow.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Prometheus-operator CRs: rendered when the API is served (or forced with monitoring.prometheusOperator=enabled). */}}
{{- define "kappa.monitoring.operator" -}}
{{- $mode := .Values.monitoring.prometheusOperator -}}
{{- if or (eq $mode "enabled") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}true{{- end -}}
{{- end -}}

{{/* NetworkPolicy peers allowed to scrape metrics: the monitoring namespace's Prometheus (both selectors must match). */}}
{{- define "kappa.networkPolicy.metricsPeers" -}}
- namespaceSelector:
    {{- toYaml .Values.networkPolicy.metrics.namespaceSelector | nindent 4 }}
  podSelector:
    {{- toYaml .Values.networkPolicy.metrics.podSelector | nindent 4 }}
{{- end -}}
