terraform {
  # Cross-variable validation blocks need Terraform >= 1.9.
  required_version = ">= 1.9.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.80.0, < 6.0.0"
    }
  }

  # State is local by default. For a shared deployment, add an S3 backend in a
  # backend.tf of your own (not committed), e.g.:
  #   backend "s3" { bucket = "...", key = "dorylus/terraform.tfstate", region = "...", use_lockfile = true }
}
