provider "aws" {
  # Credentials come from the usual AWS provider chain (environment, shared config/SSO, instance role);
  # nothing here names an account or a key.
  region = var.region

  default_tags {
    tags = merge(
      {
        Project    = "dorylus"
        Deployment = var.name
        ManagedBy  = "terraform"
      },
      var.tags,
    )
  }
}
