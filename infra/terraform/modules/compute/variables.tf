variable "name" {
  type        = string
  description = "Deployment name; prefixes the launch templates, groups, roles and log group."
}

variable "ami_id" {
  type        = string
  description = "AMI of the servers (Amazon Linux 2023: the user data uses dnf and the aws CLI)."
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets the Auto Scaling groups launch into."
}

variable "graph_server_sg_id" {
  type        = string
  description = "Security group of the graph servers."
}

variable "param_server_sg_id" {
  type        = string
  description = "Security group of the parameter servers."
}

variable "graph_server_instance_type" {
  type        = string
  description = "Instance type of the graph servers."
}

variable "graph_server_count" {
  type        = number
  description = "Number of graph servers = graph partitions; one launch template and one Auto Scaling group each."
}

variable "graph_server_volume_gb" {
  type        = number
  description = "Root volume size of a graph server in GiB."
}

variable "param_server_instance_type" {
  type        = string
  description = "Instance type of the parameter servers."
}

variable "param_server_count" {
  type        = number
  description = "Number of parameter servers (weight shards); one launch template and one Auto Scaling group each."
}

variable "param_server_volume_gb" {
  type        = number
  description = "Root volume size of a parameter server in GiB."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key of the log group and the bucket's objects."
}

variable "log_retention_days" {
  type        = number
  description = "Retention of the servers' log group in days."
}

variable "bucket_name" {
  type        = string
  description = "Deployment bucket (config, datasets, run artifacts)."
}

variable "bucket_arn" {
  type        = string
  description = "ARN of the deployment bucket."
}

variable "runs_prefix" {
  type        = string
  description = "Key prefix of run artifacts, which the servers read and write."
}

variable "config_s3_key" {
  type        = string
  description = "Key of the engine config that the servers copy to /etc/dorylus/config.toml."
}

variable "dataset_bucket" {
  type        = string
  description = "Bucket of the prepared dataset (read-only)."
}

variable "dataset_prefix" {
  type        = string
  description = "Key prefix of the prepared dataset in dataset_bucket."
}

variable "image_uri" {
  type        = string
  description = "Project image (the tensor-worker image, which has the dorylus CLI) the servers run."
}

variable "ecr_repository_arn" {
  type        = string
  description = "ECR repository the servers pull the image from."
}

variable "lambda_function_arn" {
  type        = string
  description = "Tensor-worker function the graph servers invoke."
}

variable "msk_cluster_arn" {
  type        = string
  description = "ARN of the MSK cluster (IAM auth scoping); empty when the cluster is not MSK."
}

variable "kafka_topic_prefix" {
  type        = string
  description = "Prefix of the topics and consumer groups the servers may use and create."
}

variable "user_data_template" {
  type        = string
  description = "Path of the user-data templatefile (templates/server.sh.tftpl)."
}

variable "graph_server_command" {
  type        = string
  description = "Command line a graph server runs ($PARTITION etc. expand at run time from /etc/dorylus/env)."
}

variable "tensor_worker_command" {
  type        = string
  description = "Command line of the tensor-worker process beside each graph server, in its own container and unit; empty for none."
  default     = ""
}

variable "param_server_command" {
  type        = string
  description = "Command line a parameter server runs ($DORYLUS_RUN_ID etc. expand at run time from /etc/dorylus/env)."
}

variable "driver_command" {
  type        = string
  description = "Command line of the run's driver beside the parameter server, in its own container and unit; empty for none."
  default     = ""
}

variable "environment" {
  type        = map(string)
  description = "Environment common to every server process, written to /etc/dorylus/env."
}

variable "kafka_secret_arns" {
  type        = list(string)
  description = "Secrets Manager secrets with SASL/SCRAM credentials that the role may read (empty for IAM auth)."
  default     = []
}
