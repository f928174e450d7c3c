# terraform apply -var-file=example.tfvars  (values of your EKS cluster: `aws eks describe-cluster`)
name                  = "kappa-prod"
eks_oidc_provider_arn = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.eu-west-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
eks_oidc_issuer_url   = "https://oidc.eks.eu-west-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
namespace             = "kappa"
service_accounts      = ["kappa-view", "kappa-airflow", "kappa-lake-check", "kappa-sql"]
tags = {
  environment = "prod"
}
