variable "name" {
  type        = string
  description = "Deployment name; prefixes the bucket names and the KMS alias."
}

variable "runs_prefix" {
  type        = string
  description = "Key prefix of run artifacts; the lifecycle rule expires objects under it."
}

variable "run_artifact_expiration_days" {
  type        = number
  description = "Days after which run artifacts expire."
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Days after which non-current object versions expire."
}

variable "access_log_retention_days" {
  type        = number
  description = "Days the S3 server access logs are kept."
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete non-empty buckets."
  default     = false
}
