variable "name" {
  type        = string
  description = "Deployment name; names the MSK cluster, its configuration and log group."
}

variable "create" {
  type        = bool
  description = "Create an MSK cluster (true) or pass through an existing cluster's bootstrap string (false)."
}

variable "existing_bootstrap" {
  type        = string
  description = "Bootstrap brokers of an existing Kafka cluster, used when create is false."
  default     = ""
}

variable "existing_cluster_arn" {
  type        = string
  description = "ARN of an existing MSK cluster (IAM auth), used when create is false to scope IAM permissions."
  default     = ""
}

variable "auth" {
  type        = string
  description = "Client authentication: \"iam\" or \"scram\"."
}

variable "kafka_version" {
  type        = string
  description = "Apache Kafka version of the cluster."
}

variable "broker_instance_type" {
  type        = string
  description = "Broker instance type."
}

variable "broker_count" {
  type        = number
  description = "Number of broker nodes (a multiple of the number of subnets)."
}

variable "broker_volume_gb" {
  type        = number
  description = "EBS volume size of each broker in GiB."
}

variable "default_partitions" {
  type        = number
  description = "Default partition count of new topics (the number of graph servers)."
}

variable "scram_secret_arns" {
  type        = list(string)
  description = "Secrets Manager secrets holding SCRAM credentials, associated when auth is \"scram\"."
  default     = []
}

variable "topic_prefix" {
  type        = string
  description = "Prefix of the deployment's topics and consumer groups."
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private client subnets of the brokers, one per availability zone."
}

variable "security_group_id" {
  type        = string
  description = "Security group of the brokers (null when create is false)."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for encryption at rest and the broker log group."
}

variable "log_retention_days" {
  type        = number
  description = "Retention of the broker log group in days."
}
