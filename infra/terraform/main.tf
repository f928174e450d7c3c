data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.name}-lake-${data.aws_caller_identity.current.account_id}"
  kms_key_arn = var.kms_key_arn != "" ? var.kms_key_arn : aws_kms_key.lake[0].arn
  lake_prefix = trim(var.lake_prefix, "/")
  tags        = merge({ "app.kubernetes.io/part-of" = "kappa", "kappa.io/component" = "lake" }, var.tags)
}

# ------------------------------------------------------------------------------------------ KMS
resource "aws_kms_key" "lake" {
  count                   = var.kms_key_arn == "" ? 1 : 0
  description             = "${var.name}: encryption of the kappa lake bucket"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  tags                    = local.tags

  # The account administers the key (AWS's default key policy delegates to IAM; in a key policy "*" means
  # this key); using it for data is granted to the jobs role only (here and in its IAM policy).
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministersTheKey"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action = [
          "kms:Create*", "kms:Describe*", "kms:Enable*", "kms:List*", "kms:Put*", "kms:Update*", "kms:Revoke*",
          "kms:Disable*", "kms:Get*", "kms:Delete*", "kms:TagResource", "kms:UntagResource",
          "kms:ScheduleKeyDeletion", "kms:CancelKeyDeletion",
        ]
        Resource = "*"
      },
      {
        Sid       = "JobsUseTheKey"
        Effect    = "Allow"
        Principal = { AWS = aws_iam_role.jobs.arn }
        Action    = ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"]
        Resource  = "*"
      },
    ]
  })
}

resource "aws_kms_alias" "lake" {
  count         = var.kms_key_arn == "" ? 1 : 0
  name          = "alias/${var.name}-lake"
  target_key_id = aws_kms_key.lake[0].key_id
}

# ------------------------------------------------------------------------------------------ bucket
resource "aws_s3_bucket" "lake" {
  bucket        = local.bucket_name
  force_destroy = var.force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_ownership_controls" "lake" {
  bucket = aws_s3_bucket.lake.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "lake" {
  bucket                  = aws_s3_bucket.lake.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# Versioning: an overwritten or deleted Delta log / checkpoint file can be restored.
resource "aws_s3_bucket_versioning" "lake" {
  bucket = aws_s3_bucket.lake.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "lake" {
  bucket = aws_s3_bucket.lake.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = local.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "lake" {
  bucket = aws_s3_bucket.lake.id

  rule {
    id     = "noncurrent-versions-and-incomplete-uploads"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_retention_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.lake]
}

resource "aws_s3_bucket_logging" "lake" {
  count         = var.access_log_bucket != "" ? 1 : 0
  bucket        = aws_s3_bucket.lake.id
  target_bucket = var.access_log_bucket
  target_prefix = "s3-access/${local.bucket_name}/"
}

# TLS only.
data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.lake.arn,
      "${aws_s3_bucket.lake.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "lake" {
  bucket     = aws_s3_bucket.lake.id
  policy     = data.aws_iam_policy_document.bucket.json
  depends_on = [aws_s3_bucket_public_access_block.lake]
}
