output "region" {
  description = "Region of the deployment."
  value       = var.region
}

output "kafka_bootstrap_brokers" {
  description = "Bootstrap brokers (TLS, with the configured auth) of the Kafka cluster."
  value       = module.kafka.bootstrap_brokers
}

output "kafka_cluster_arn" {
  description = "ARN of the MSK cluster (empty when an existing non-MSK cluster is used)."
  value       = module.kafka.cluster_arn
}

output "lambda_function_name" {
  description = "Name of the tensor-worker Lambda function."
  value       = module.tensor_workers.function_name
}

output "lambda_function_arn" {
  description = "ARN of the tensor-worker Lambda function."
  value       = module.tensor_workers.function_arn
}

output "lambda_reserved_concurrency" {
  description = "Reserved concurrency of the tensor-worker function."
  value       = var.lambda_reserved_concurrency
}

output "ecr_repository_url" {
  description = "ECR repository to push the image built from infra/lambda/Dockerfile to."
  value       = module.tensor_workers.ecr_repository_url
}

output "image_uri" {
  description = "Image the Lambda function and the servers run."
  value       = module.tensor_workers.image_uri
}

output "bucket_name" {
  description = "Deployment bucket (config, datasets, run artifacts)."
  value       = module.storage.bucket_name
}

output "access_log_bucket_name" {
  description = "Bucket that receives the deployment bucket's S3 server access logs."
  value       = module.storage.access_log_bucket_name
}

output "kms_key_arn" {
  description = "KMS key that encrypts the bucket, MSK, ECR, the log groups and the Lambda environment."
  value       = module.storage.kms_key_arn
}

output "config_uri" {
  description = "Where to upload the engine config before the servers start."
  value       = "s3://${module.storage.bucket_name}/${var.config_s3_key}"
}

output "dataset_uri" {
  description = "Where the servers read the prepared dataset from."
  value       = local.dataset_full_uri
}

output "graph_server_group_names" {
  description = "Auto Scaling group names of the graph servers, indexed by partition."
  value       = module.compute.graph_server_group_names
}

output "param_server_group_names" {
  description = "Auto Scaling group names of the parameter servers, indexed by shard."
  value       = module.compute.param_server_group_names
}

output "server_log_group_name" {
  description = "CloudWatch log group of the graph and parameter server containers."
  value       = module.compute.log_group_name
}

output "vpc_id" {
  description = "VPC of the deployment."
  value       = module.network.vpc_id
}

output "private_subnet_ids" {
  description = "Private subnets of the deployment."
  value       = module.network.private_subnet_ids
}
