{{/* ---------------------------------------------------------------- Airflow helpers */}}

{{- define "kappa.airflow.secretName" -}}
{{- default (include "kappa.workloadName" (list . "airflow")) .Values.airflow.secrets.existingSecret -}}
{{- end -}}

{{- define "kappa.postgresql.secretName" -}}
{{- default (include "kappa.workloadName" (list . "postgresql")) .Values.airflow.postgresql.existingSecret -}}
{{- end -}}

{{- define "kappa.airflow.apiServerUrl" -}}
{{- printf "http://%s.%s.svc.%s:%d" (include "kappa.workloadName" (list . "airflow-api-server")) .Release.Namespace .Values.clusterDomain (int .Values.airflow.apiServer.service.port) -}}
{{- end -}}

{{/*
Environment of every Airflow container: Airflow settings (secrets as Secret refs), the platform's
connection settings (same as the view drivers) and the Kubernetes runner's settings.
*/}}
{{- define "kappa.airflow.env" -}}
{{- $a := .Values.airflow -}}
- name: AIRFLOW_HOME
  value: /opt/airflow
- name: AIRFLOW__CORE__DAGS_FOLDER
  value: /opt/kappa/dags
- name: AIRFLOW__CORE__EXECUTOR
  value: LocalExecutor
- name: AIRFLOW__CORE__LOAD_EXAMPLES
  value: "False"
- name: AIRFLOW__CORE__EXECUTION_API_SERVER_URL
  value: {{ printf "%s/execution/" (include "kappa.airflow.apiServerUrl" .) | quote }}
# a task started while the API server is not answering (starting, or restarted by its liveness probe) waits
# for it: 20 calls at least 10 s apart instead of Airflow's 5 within 15 s (kappa.front.stack sets the same)
- name: AIRFLOW__WORKERS__EXECUTION_API_RETRIES
  value: "20"
- name: AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MIN
  value: "10"
- name: AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX
  value: "20"
- name: AIRFLOW__CORE__AUTH_MANAGER
  value: airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager
- name: AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS
  value: {{ printf "%s:admin" $a.auth.adminUsername | quote }}
- name: AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE
  value: /opt/airflow/simple_auth_manager_passwords.json
- name: AIRFLOW__LOGGING__BASE_LOG_FOLDER
  value: /opt/airflow/logs
- name: AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK
  value: "True"
# task logs are fetched from the pod that ran the task: address it by IP (pod names do not resolve)
- name: AIRFLOW__CORE__HOSTNAME_CALLABLE
  value: airflow.utils.net.get_host_ip_address
- name: AIRFLOW__CORE__FERNET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kappa.airflow.secretName" . }}
      key: fernet-key
- name: AIRFLOW__API__SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kappa.airflow.secretName" . }}
      key: api-secret-key
- name: AIRFLOW__API_AUTH__JWT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "kappa.airflow.secretName" . }}
      key: jwt-secret
{{- if $a.postgresql.enabled }}
- name: KAPPA_AIRFLOW_DB_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kappa.postgresql.secretName" . }}
      key: {{ $a.postgresql.passwordKey }}
# $(VAR) is expanded by the kubelet; the bundled database's password is alphanumeric (URL-safe)
- name: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN
  value: {{ printf "postgresql+psycopg2://%s:$(KAPPA_AIRFLOW_DB_PASSWORD)@%s:5432/%s" $a.postgresql.username (include "kappa.workloadName" (list . "postgresql")) $a.postgresql.database | quote }}
{{- else }}
- name: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN
  valueFrom:
    secretKeyRef:
      name: {{ $a.externalDatabase.existingSecret }}
      key: {{ $a.externalDatabase.connectionKey }}
{{- end }}
# the same URL for kappa_retire's `airflow db clean`: Airflow 3 replaces the one above in a task's environment
- name: KAPPA_AIRFLOW_DB_CONN
  value: "$(AIRFLOW__DATABASE__SQL_ALCHEMY_CONN)"
- name: KAPPA_RUNNER
  value: kubernetes
- name: KAPPA_K8S_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: KAPPA_VIEW_TEMPLATE_DIR
  value: /etc/kappa/view-template
# the root filesystem (and HOME=/home/airflow, which holds the image's packages) is read-only: caches go to /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: XDG_CONFIG_HOME
  value: /tmp/.config
- name: MPLCONFIGDIR
  value: /tmp/.matplotlib
{{- include "kappa.platformEnv" . }}
{{- with $a.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kappa.airflow.volumeMounts" -}}
- name: airflow-home
  mountPath: /opt/airflow
- name: view-template
  mountPath: /etc/kappa/view-template
  readOnly: true
{{ include "kappa.platformVolumeMounts" . }}
{{- end -}}

{{- define "kappa.airflow.volumes" -}}
- name: airflow-home
  emptyDir:
    sizeLimit: 2Gi
- name: view-template
  configMap:
    name: {{ include "kappa.workloadName" (list . "view-template") }}
{{ include "kappa.platformVolumes" (list . .Values.airflow.tmpSizeLimit) }}
{{- end -}}

{{/*
Pod skeleton shared by the Airflow components.
Usage: include "kappa.airflow.pod" (dict "root" $ "workload" "airflow-scheduler" "cfg" .Values.airflow.scheduler
                                         "args" (list ...) "apiAccess" true "lake" true "container" <yaml string>)
"container" carries the component-specific ports/probes.
*/}}
{{- define "kappa.airflow.podSpec" -}}
{{- $root := .root -}}
{{- $a := $root.Values.airflow -}}
serviceAccountName: {{ include "kappa.airflow.serviceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: 60
{{- include "kappa.imagePullSecrets" $root }}
{{- /* uid 50000 / gid 0 as the official image expects; fsGroup = the lake's group (shared with the drivers) */}}
{{ include "kappa.podSecurityContext" (dict "uid" 50000 "gid" 0 "fsGroup" 10001) }}
{{- if .lake }}
{{- include "kappa.lake.affinity" (list $root $a.affinity) }}
{{- else }}
{{- with $a.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- with $a.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $a.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
initContainers:
  # components start once `airflow db migrate` (the migrations Job of this revision) has run
  - name: wait-for-migrations
    image: {{ include "kappa.image" (dict "image" $a.image "root" $root) }}
    imagePullPolicy: {{ $a.image.pullPolicy }}
    args: ["airflow", "db", "check-migrations", "--migration-wait-timeout", "600"]
    env:
      {{- include "kappa.airflow.env" $root | nindent 6 }}
    envFrom:
      {{- include "kappa.platformEnvFrom" $root | nindent 6 }}
    resources:
      {{- toYaml $a.initResources | nindent 6 }}
    {{- include "kappa.containerSecurityContext" $root | nindent 4 }}
    volumeMounts:
      {{- include "kappa.airflow.volumeMounts" $root | nindent 6 }}
  {{- with .extraInit }}
  {{- . | nindent 2 }}
  {{- end }}
containers:
  - name: {{ .containerName }}
    image: {{ include "kappa.image" (dict "image" $a.image "root" $root) }}
    imagePullPolicy: {{ $a.image.pullPolicy }}
    args:
      {{- toYaml .args | nindent 6 }}
    env:
      {{- include "kappa.airflow.env" $root | nindent 6 }}
    envFrom:
      {{- include "kappa.platformEnvFrom" $root | nindent 6 }}
    {{- .container | nindent 4 }}
    resources:
      {{- toYaml .cfg.resources | nindent 6 }}
    {{- include "kappa.containerSecurityContext" $root | nindent 4 }}
    volumeMounts:
      {{- include "kappa.airflow.volumeMounts" $root | nindent 6 }}
      {{- if .apiAccess }}
      {{- include "kappa.apiAccessVolumeMount" $root | nindent 6 }}
      {{- end }}
volumes:
  {{- include "kappa.airflow.volumes" $root | nindent 2 }}
  {{- if .apiAccess }}
  {{- include "kappa.apiAccessVolume" $root | nindent 2 }}
  {{- end }}
  {{- with .extraVolumes }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* Pod labels of an Airflow component (plus the lake co-location label when it mounts the lake). */}}
{{- define "kappa.airflow.podLabels" -}}
{{ include "kappa.labels" (list .root .workload .workload) }}
kappa.io/airflow: "true"
{{- if and .lake (include "kappa.lake.colocate" .root) }}
kappa.io/lake-claim: {{ include "kappa.lake.claimName" .root }}
{{- end }}
{{- end -}}

{{- define "kappa.airflow.podAnnotations" -}}
checksum/platform-env: {{ include (print .Template.BasePath "/views/configmap-platform-env.yaml") . | sha256sum }}
{{- with .Values.airflow.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
exec probe for the components without an HTTP endpoint (the official chart's approach). Liveness only: no Service
sends them traffic, so readiness would gate nothing but `helm upgrade --wait`, and `airflow jobs check` is a whole
Airflow start in Python - on a busy 2-core node it took longer than any sane probe timeout and held upgrades for
minutes while both components were working. Ten failed checks in a row (10 minutes) restart the component: with five,
a 2-core node running the views, a replay's driver and its verification (load average 20-25) restarted both
working components twice during one replay, each check timing out after 45 s.
*/}}
{{- define "kappa.airflow.jobCheckProbes" -}}
livenessProbe:
  exec:
    command: ["airflow", "jobs", "check", "--job-type", {{ .jobType | quote }}, "--local"]
  initialDelaySeconds: 60
  periodSeconds: 60
  timeoutSeconds: 45
  failureThreshold: 10
{{- end -}}
