{{/*
Invalid value combinations fail the render (helm install/upgrade/template/lint) with one clear message.
Included from NOTES.txt, which Helm renders together with the manifests -- before anything is applied --
on install, upgrade, lint and template (template renders NOTES.txt without printing it).
*/}}
{{- define "kappa.validate" -}}
{{- $ext := .Values.kafka.external -}}
{{- if $ext.enabled -}}
  {{- if not $ext.bootstrapServers -}}
    {{- fail "kafka.external.enabled=true requires kafka.external.bootstrapServers (host:port[,host:port...])" -}}
  {{- end -}}
  {{- if hasPrefix "SASL_" $ext.securityProtocol -}}
    {{- if not $ext.sasl.mechanism -}}
      {{- fail (printf "kafka.external.securityProtocol=%s requires kafka.external.sasl.mechanism" $ext.securityProtocol) -}}
    {{- end -}}
    {{- if not $ext.sasl.existingSecret -}}
      {{- fail (printf "kafka.external.securityProtocol=%s requires kafka.external.sasl.existingSecret (username/password are never taken from values)" $ext.securityProtocol) -}}
    {{- end -}}
  {{- else if $ext.sasl.existingSecret -}}
    {{- fail (printf "kafka.external.sasl.existingSecret is set but kafka.external.securityProtocol=%s is not SASL_PLAINTEXT/SASL_SSL" $ext.securityProtocol) -}}
  {{- end -}}
  {{- if and $ext.tls.existingSecret (not (hasSuffix "SSL" $ext.securityProtocol)) -}}
    {{- fail (printf "kafka.external.tls.existingSecret is set but kafka.external.securityProtocol=%s does not use TLS" $ext.securityProtocol) -}}
  {{- end -}}
{{- else -}}
  {{- /* bundled brokers: every topic's effective replication factor must fit the cluster */ -}}
  {{- $platform := include "kappa.platform" . | fromJson -}}
  {{- $override := int .Values.kafka.topics.replicationFactor -}}
  {{- range $topic, $decl := $platform.topics -}}
    {{- $rf := $override | default (int $decl.replication_factor) -}}
    {{- if gt (int $rf) (int $.Values.kafka.replicas) -}}
      {{- fail (printf "topic %s needs replication factor %d but kafka.replicas=%d (set kafka.topics.replicationFactor)" $topic (int $rf) (int $.Values.kafka.replicas)) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- if eq .Values.lake.type "s3" -}}
  {{- if not (hasPrefix "s3a://" .Values.lake.s3.uri) -}}
    {{- fail "lake.type=s3 requires lake.s3.uri of the form s3a://<bucket>/<prefix>" -}}
  {{- end -}}
  {{- if and (not .Values.lake.s3.existingSecret) (not .Values.lake.s3.irsaRoleArn) -}}
    {{- fail "lake.type=s3 requires credentials: lake.s3.existingSecret (static keys) or lake.s3.irsaRoleArn (IRSA)" -}}
  {{- end -}}
{{- end -}}
{{- if and (eq .Values.viewJobs.spark.mode "kubernetes") (eq .Values.lake.type "pvc") (eq .Values.lake.persistence.accessMode "ReadWriteOnce") (not .Values.lake.persistence.colocatePods) -}}
  {{- fail "viewJobs.spark.mode=kubernetes with a ReadWriteOnce lake PVC needs lake.persistence.colocatePods=true or accessMode ReadWriteMany (executors mount the lake)" -}}
{{- end -}}
{{- if and (eq .Values.viewJobs.grouping "grouped") (eq .Values.viewJobs.spark.mode "kubernetes") -}}
  {{- fail "viewJobs.grouping=grouped runs every view in one driver with Spark local mode; use viewJobs.spark.mode=local, or grouping=perView for Spark-on-Kubernetes" -}}
{{- end -}}
{{- if and .Values.airflow.enabled (not .Values.airflow.postgresql.enabled) (not .Values.airflow.externalDatabase.existingSecret) -}}
  {{- fail "airflow.postgresql.enabled=false requires airflow.externalDatabase.existingSecret (SQLAlchemy URL of the metadata DB)" -}}
{{- end -}}
{{- $platform := include "kappa.platform" . | fromJson -}}
{{- range $view, $_ := .Values.views -}}
  {{- if not (hasKey $platform.views $view) -}}
    {{- fail (printf "views.%s: no such view in kappa/platform.yaml (declared: %s)" $view (keys $platform.views | sortAlpha | join ", ")) -}}
  {{- end -}}
{{- end -}}
{{- $_ := include "kappa.runningViews" . -}}
{{- end -}}
