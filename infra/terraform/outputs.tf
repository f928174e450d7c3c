output "bucket_name" {
  description = "Name of the lake bucket."
  value       = aws_s3_bucket.lake.id
}

output "bucket_arn" {
  description = "ARN of the lake bucket."
  value       = aws_s3_bucket.lake.arn
}

output "kms_key_arn" {
  description = "KMS key encrypting the lake bucket."
  value       = local.kms_key_arn
}

output "lake_uri" {
  description = "KAPPA_LAKE_URI for the chart (lake.s3.uri)."
  value       = "s3a://${aws_s3_bucket.lake.id}/${local.lake_prefix}"
}

output "jobs_role_arn" {
  description = "IAM role for the chart's ServiceAccounts (lake.s3.irsaRoleArn)."
  value       = aws_iam_role.jobs.arn
}

output "helm_values" {
  description = "Values to pass to the chart (helm ... -f <(terraform output -json helm_values))."
  value = {
    lake = {
      type = "s3"
      s3 = {
        uri         = "s3a://${aws_s3_bucket.lake.id}/${local.lake_prefix}"
        region      = data.aws_region.current.region
        irsaRoleArn = aws_iam_role.jobs.arn
      }
    }
  }
}

data "aws_region" "current" {}
