variable "name" {
  description = "Name prefix of every resource (e.g. kappa-prod)."
  type        = string
  default     = "kappa"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 lowercase letters, digits or dashes."
  }
}

variable "bucket_name" {
  description = "Name of the lake bucket (globally unique). Empty: <name>-lake-<account id>."
  type        = string
  default     = ""
}

variable "lake_prefix" {
  description = "Key prefix of the lake inside the bucket (KAPPA_LAKE_URI = s3a://<bucket>/<prefix>)."
  type        = string
  default     = "kappa"
}

variable "kms_key_arn" {
  description = "Existing KMS key for bucket encryption. Empty: a dedicated key with rotation is created."
  type        = string
  default     = ""
}

variable "access_log_bucket" {
  description = "Existing bucket receiving S3 server access logs of the lake bucket. Empty: access logging off."
  type        = string
  default     = ""
}

variable "noncurrent_version_retention_days" {
  description = "Days noncurrent object versions are kept (undo window for overwritten Delta log/checkpoint files)."
  type        = number
  default     = 30
}

variable "force_destroy" {
  description = "Allow `destroy` to delete a non-empty bucket. Keep false outside throw-away environments."
  type        = bool
  default     = false
}

variable "eks_oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider (aws_iam_openid_connect_provider), for IRSA."
  type        = string
}

variable "eks_oidc_issuer_url" {
  description = "Issuer URL of the EKS cluster's OIDC provider (https://oidc.eks.<region>.amazonaws.com/id/<id>)."
  type        = string

  validation {
    condition     = startswith(var.eks_oidc_issuer_url, "https://")
    error_message = "eks_oidc_issuer_url must start with https://."
  }
}

variable "namespace" {
  description = "Kubernetes namespace of the Helm release."
  type        = string
  default     = "kappa"
}

variable "service_accounts" {
  description = "ServiceAccounts allowed to assume the jobs role: the chart's view drivers/executors, Airflow, the lake check hook and the analysts' SQL service (<fullname>-view, <fullname>-airflow, <fullname>-lake-check, <fullname>-sql)."
  type        = list(string)
  default     = ["kappa-view", "kappa-airflow", "kappa-lake-check", "kappa-sql"]
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
