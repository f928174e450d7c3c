terraform {
  # OpenTofu >= 1.6 or Terraform >= 1.6
  required_version = ">= 1.6.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.0"
    }
  }
}
