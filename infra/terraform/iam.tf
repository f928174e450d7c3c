# IAM role for the view drivers, Spark executors and Airflow (IRSA): the chart annotates their
# ServiceAccounts with lake.s3.irsaRoleArn = jobs_role_arn.

locals {
  oidc_issuer = trimprefix(var.eks_oidc_issuer_url, "https://")
}

data "aws_iam_policy_document" "jobs_assume" {
  statement {
    sid     = "KappaServiceAccounts"
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.eks_oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = [for sa in var.service_accounts : "system:serviceaccount:${var.namespace}:${sa}"]
    }
  }
}

resource "aws_iam_role" "jobs" {
  name                 = "${var.name}-jobs"
  description          = "kappa view drivers, Spark executors, Airflow and the SQL service (IRSA) - lake access"
  assume_role_policy   = data.aws_iam_policy_document.jobs_assume.json
  max_session_duration = 3600
  tags                 = local.tags
}

data "aws_iam_policy_document" "jobs" {
  statement {
    sid       = "ListLakePrefix"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.lake.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["", local.lake_prefix, "${local.lake_prefix}/*"]
    }
  }

  statement {
    sid = "ReadWriteLakeObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${aws_s3_bucket.lake.arn}/${local.lake_prefix}/*"]
  }

  statement {
    sid       = "UseLakeKey"
    actions   = ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"]
    resources = [local.kms_key_arn]
  }
}

resource "aws_iam_policy" "jobs" {
  name        = "${var.name}-jobs-lake"
  description = "Read/write the kappa lake prefix and use its KMS key"
  policy      = data.aws_iam_policy_document.jobs.json
  tags        = local.tags
}

resource "aws_iam_role_policy_attachment" "jobs" {
  role       = aws_iam_role.jobs.name
  policy_arn = aws_iam_policy.jobs.arn
}
