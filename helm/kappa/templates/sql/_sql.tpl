{{/*
The analysts' SQL service (`kappa sql serve`, kappa/front/sql/server.py; docs/analysts.md): ONE pod running one Spark
application with two endpoints, JDBC (Spark's Thrift server, HiveServer2 binary protocol) on sql.jdbcPort and Spark
Connect on sql.connectPort, over analytics.<view> (the serving versions), kappa.freshness, kappa.quarantine and
kappa.registry*. Read-only by its guards (a Spark check rule and a Spark Connect interceptor in the image's
.cache/jars/sql/kappa-sql.jar) and, with a PVC lake, by its mount (readOnly). Token: sql.auth.
*/}}

{{/* Secret holding the token: sql.auth.existingSecret, else the generated <fullname>-sql. */}}
{{- define "kappa.sql.secretName" -}}
{{- default (include "kappa.workloadName" (list . "sql")) .Values.sql.auth.existingSecret -}}
{{- end -}}

{{/*
TCP port of the lake's object store (lake.type=s3) the service connects to: the port of lake.s3.endpoint (its scheme's
default when it names none), 443 for AWS (no endpoint).
*/}}
{{- define "kappa.sql.lakePort" -}}
{{- with .Values.lake.s3.endpoint -}}
{{- $u := urlParse . -}}
{{- $hostPort := splitList ":" $u.host -}}
{{- if gt (len $hostPort) 1 -}}
{{- last $hostPort | int -}}
{{- else if eq $u.scheme "http" -}}
80
{{- else -}}
443
{{- end -}}
{{- else -}}
443
{{- end -}}
{{- end -}}
