{{/*
The view-workload templates: ONE definition used twice.

  1. views/deployments.yaml renders it for every running view version (kappa/platform.yaml
     default_version, or .Values.views.<view>.versions).
  2. views/configmap-view-template.yaml renders it once with placeholders
       __KAPPA_VIEW__        view name as declared (campaign_window_counts)
       __KAPPA_VIEW_SLUG__   its DNS-label form (campaign-window-counts)
       __KAPPA_VERSION__     view version (integer)
       __KAPPA_STARTING__    starting position (earliest | latest | JSON offsets | ts:<epoch ms>)
     into a ConfigMap that the in-cluster Kubernetes runner (kappa/runners/kubernetes.py) reads, so a
     replay started from Airflow creates exactly the object the chart would have created.

Arguments (dict): root ($), view, slug, version (string), starting.
*/}}

{{- define "kappa.view.workload" -}}
{{- printf "view-%s-v%s" .slug .version -}}
{{- end -}}

{{- define "kappa.view.deployment" -}}
{{- $root := .root -}}
{{- $workload := include "kappa.view.workload" . -}}
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
    kappa.io/view: {{ .view | quote }}
    kappa.io/view-version: {{ .version | quote }}
  annotations:
    # Helm ownership metadata is part of the template so that a driver started by the Kubernetes
    # runner is adopted (not refused) when the same version is later pinned in values.
    meta.helm.sh/release-name: {{ $root.Release.Name }}
    meta.helm.sh/release-namespace: {{ $root.Release.Namespace }}
    kappa.io/starting: {{ .starting | quote }}
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
        kappa.io/view: {{ .view | quote }}
        kappa.io/view-version: {{ .version | quote }}
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
            - kappa
            - view
            - run
            - {{ .view | quote }}
            - --version
            - {{ .version | quote }}
            - --starting
            - {{ .starting | quote }}
            - --metrics-port
            - {{ $v.metricsPort | quote }}
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
            {{- if $k8s }}
            # per-driver Spark settings (the shared ones are in spark-defaults.conf): executors reach
            # this driver through its headless Service and are owned by (garbage-collected with) its pod
            - name: PYSPARK_SUBMIT_ARGS
              value: >-
                --conf spark.kubernetes.driver.pod.name=$(POD_NAME)
                --conf spark.driver.host={{ $name }}-driver.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}
                --conf spark.kubernetes.executor.podNamePrefix={{ $name }}
                --conf spark.kubernetes.executor.label.kappa.io/view={{ .view }}
                --conf spark.kubernetes.executor.label.kappa.io/view-version={{ .version }}
                pyspark-shell
            {{- end }}
            {{- with include "kappa.platformEnv" $root }}{{ . | trim | nindent 12 }}{{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          envFrom:
            {{- include "kappa.platformEnvFrom" $root | nindent 12 }}
          ports:
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
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
          # the metrics endpoint comes up with the driver process; Spark start-up (JVM, catalog, first
          # batch planning) can take minutes, hence a startup probe before liveness applies
          startupProbe:
            httpGet:
              path: /metrics
              port: metrics
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: {{ $v.startupProbeFailureThreshold }}
          readinessProbe:
            httpGet:
              path: /metrics
              port: metrics
            periodSeconds: 15
            timeoutSeconds: 5
            failureThreshold: 3
          livenessProbe:
            httpGet:
              path: /metrics
              port: metrics
            periodSeconds: 30
            timeoutSeconds: 10
            failureThreshold: 4
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          {{- include "kappa.containerSecurityContext" $root | nindent 10 }}
          volumeMounts:
            {{- include "kappa.platformVolumeMounts" $root | nindent 12 }}
            - name: spark-conf
              mountPath: /opt/kappa/spark-conf
              readOnly: true
            {{- if $k8s }}
            {{- include "kappa.apiAccessVolumeMount" $root | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "kappa.platformVolumes" (list $root $v.tmpSizeLimit) | nindent 8 }}
        - name: spark-conf
          configMap:
            name: {{ include "kappa.workloadName" (list $root "spark-conf") }}
        {{- if $k8s }}
        {{- include "kappa.apiAccessVolume" $root | nindent 8 }}
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
