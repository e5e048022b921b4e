variable "name" {
  type        = string
  description = "Deployment name; names the function, its role, log group and ECR repository."
}

variable "image_tag" {
  type        = string
  description = "Tag of the image in the deployment's ECR repository."
}

variable "image_uri" {
  type        = string
  description = "Full image URI overriding the repository and tag; empty uses them."
  default     = ""
}

variable "architecture" {
  type        = string
  description = "Instruction set of the function: x86_64 or arm64."
}

variable "memory_mb" {
  type        = number
  description = "Memory of the function in MB."
}

variable "timeout_s" {
  type        = number
  description = "Timeout of one invocation in seconds."
}

variable "reserved_concurrency" {
  type        = number
  description = "Reserved concurrent executions of the function."
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets the function's network interfaces live in."
}

variable "security_group_id" {
  type        = string
  description = "Security group of the function."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for the repository, the log group, the environment and the bucket's objects."
}

variable "log_retention_days" {
  type        = number
  description = "Retention of the function's log group in days."
}

variable "bucket_name" {
  type        = string
  description = "Deployment bucket."
}

variable "bucket_arn" {
  type        = string
  description = "ARN of the deployment bucket."
}

variable "s3_prefix" {
  type        = string
  description = "Key prefix in the bucket that the function may read and write."
}

variable "msk_cluster_arn" {
  type        = string
  description = "ARN of the MSK cluster (IAM auth scoping); empty when the cluster is not MSK."
}

variable "kafka_bootstrap" {
  type        = string
  description = "Bootstrap brokers handed to the function's environment."
}

variable "kafka_auth" {
  type        = string
  description = "Kafka client auth (\"iam\" or \"scram\"), handed to the function's environment."
}

variable "kafka_topic_prefix" {
  type        = string
  description = "Prefix of the topics and consumer groups the function may use."
}

variable "image_retention_count" {
  type        = number
  description = "Number of images the ECR lifecycle policy keeps."
  default     = 20
}

variable "force_delete" {
  type        = bool
  description = "Let terraform destroy delete the ECR repository even when it holds images."
  default     = false
}

variable "kafka_secret_arns" {
  type        = list(string)
  description = "Secrets Manager secrets with SASL/SCRAM credentials that the role may read (empty for IAM auth)."
  default     = []
}
