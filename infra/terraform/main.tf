# Dorylus on AWS: CPU graph servers and a parameter server on EC2, tensor workers on Lambda, Kafka (MSK) between them.
#
#   storage         KMS key, deployment bucket (runs, datasets, config), access-log bucket
#   network         VPC, private subnets, VPC endpoints, security groups, flow logs
#   kafka           MSK (TLS + IAM or SASL/SCRAM), or an existing cluster's bootstrap string
#   tensor_workers  ECR repository, container-image Lambda, its least-privilege role
#   compute         one launch template + one Auto Scaling group (size 1) per graph partition and per parameter shard

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_ssm_parameter" "ami" {
  count = var.ami_id == "" ? 1 : 0
  name  = var.ami_ssm_parameter
}

locals {
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition

  ami_id = var.ami_id != "" ? var.ami_id : nonsensitive(data.aws_ssm_parameter.ami[0].value)

  kafka_ports = length(var.kafka_ports) > 0 ? var.kafka_ports : (var.kafka_auth == "iam" ? [9098] : [9096])

  # dataset_uri is either s3://bucket/prefix (another bucket) or a prefix inside the deployment bucket.
  dataset_external = startswith(var.dataset_uri, "s3://")
  dataset_bucket   = local.dataset_external ? split("/", trimprefix(var.dataset_uri, "s3://"))[0] : module.storage.bucket_name
  dataset_prefix = (local.dataset_external
    ? join("/", slice(split("/", trimprefix(var.dataset_uri, "s3://")), 1, length(split("/", trimprefix(var.dataset_uri, "s3://")))))
    : var.dataset_uri
  )
  dataset_full_uri = "s3://${local.dataset_bucket}/${local.dataset_prefix}"
}

module "storage" {
  source = "./modules/storage"

  name                               = var.name
  runs_prefix                        = var.runs_prefix
  run_artifact_expiration_days       = var.run_artifact_expiration_days
  noncurrent_version_expiration_days = var.noncurrent_version_expiration_days
  access_log_retention_days          = var.log_retention_days
  force_destroy                      = var.force_destroy
}

module "network" {
  source = "./modules/network"

  name                       = var.name
  vpc_cidr                   = var.vpc_cidr
  availability_zones         = var.availability_zones
  kafka_ports                = local.kafka_ports
  create_msk                 = var.create_msk
  existing_kafka_cidr_blocks = var.existing_kafka_cidr_blocks
  kms_key_arn                = module.storage.kms_key_arn
  log_retention_days         = var.log_retention_days
}

module "kafka" {
  source = "./modules/kafka"

  name                 = var.name
  create               = var.create_msk
  existing_bootstrap   = var.existing_kafka_bootstrap
  existing_cluster_arn = var.existing_msk_cluster_arn
  auth                 = var.kafka_auth
  kafka_version        = var.kafka_version
  broker_instance_type = var.kafka_broker_instance_type
  broker_count         = var.kafka_broker_count
  broker_volume_gb     = var.kafka_broker_volume_gb
  default_partitions   = var.graph_server_count
  scram_secret_arns    = var.msk_scram_secret_arns
  topic_prefix         = var.kafka_topic_prefix
  subnet_ids           = module.network.private_subnet_ids
  security_group_id    = module.network.msk_security_group_id
  kms_key_arn          = module.storage.kms_key_arn
  log_retention_days   = var.log_retention_days
}

module "tensor_workers" {
  source = "./modules/tensor_workers"

  name                 = var.name
  image_tag            = var.lambda_image_tag
  image_uri            = var.lambda_image_uri
  architecture         = var.lambda_architecture
  memory_mb            = var.lambda_memory_mb
  timeout_s            = var.lambda_timeout_s
  reserved_concurrency = var.lambda_reserved_concurrency
  subnet_ids           = module.network.private_subnet_ids
  security_group_id    = module.network.lambda_security_group_id
  kms_key_arn          = module.storage.kms_key_arn
  log_retention_days   = var.log_retention_days
  bucket_name          = module.storage.bucket_name
  bucket_arn           = module.storage.bucket_arn
  s3_prefix            = var.lambda_s3_prefix
  msk_cluster_arn      = module.kafka.cluster_arn
  kafka_bootstrap      = module.kafka.bootstrap_brokers
  kafka_auth           = var.kafka_auth
  kafka_topic_prefix   = var.kafka_topic_prefix
  kafka_secret_arns    = var.kafka_auth == "scram" ? var.msk_scram_secret_arns : []
  force_delete         = var.force_destroy
}

module "compute" {
  source = "./modules/compute"

  name                       = var.name
  ami_id                     = local.ami_id
  subnet_ids                 = module.network.private_subnet_ids
  graph_server_sg_id         = module.network.graph_server_security_group_id
  param_server_sg_id         = module.network.param_server_security_group_id
  graph_server_instance_type = var.graph_server_instance_type
  graph_server_count         = var.graph_server_count
  graph_server_volume_gb     = var.graph_server_volume_gb
  param_server_instance_type = var.param_server_instance_type
  param_server_count         = var.param_server_count
  param_server_volume_gb     = var.param_server_volume_gb
  kms_key_arn                = module.storage.kms_key_arn
  log_retention_days         = var.log_retention_days
  bucket_name                = module.storage.bucket_name
  bucket_arn                 = module.storage.bucket_arn
  runs_prefix                = var.runs_prefix
  config_s3_key              = var.config_s3_key
  dataset_bucket             = local.dataset_bucket
  dataset_prefix             = local.dataset_prefix
  image_uri                  = module.tensor_workers.image_uri
  ecr_repository_arn         = module.tensor_workers.ecr_repository_arn
  lambda_function_arn        = module.tensor_workers.function_arn
  msk_cluster_arn            = module.kafka.cluster_arn
  kafka_topic_prefix         = var.kafka_topic_prefix
  kafka_secret_arns          = var.kafka_auth == "scram" ? var.msk_scram_secret_arns : []
  user_data_template         = "${path.module}/templates/server.sh.tftpl"
  graph_server_command       = var.graph_server_command
  tensor_worker_command      = var.tensor_worker_command
  param_server_command       = var.param_server_command
  driver_command             = var.driver_command

  # Environment of every server process (/etc/dorylus/env); the command lines may refer to these.
  environment = {
    AWS_REGION                 = var.region
    AWS_DEFAULT_REGION         = var.region
    DORYLUS_BOOTSTRAP          = module.kafka.bootstrap_brokers
    DORYLUS_RUN_ID             = var.run_id
    DORYLUS_KAFKA_AUTH         = var.kafka_auth
    DORYLUS_KAFKA_SECRET_ARN   = var.kafka_auth == "scram" ? try(var.msk_scram_secret_arns[0], "") : ""
    DORYLUS_TOPIC_PREFIX       = var.kafka_topic_prefix
    DORYLUS_BUCKET             = module.storage.bucket_name
    DORYLUS_RUNS_URI           = "s3://${module.storage.bucket_name}/${var.runs_prefix}"
    DORYLUS_DATASET_URI        = local.dataset_full_uri
    DORYLUS_LAMBDA_FUNCTION    = module.tensor_workers.function_name
    DORYLUS_LAMBDAS_PER_SERVER = tostring(var.lambdas_per_graph_server)
    DORYLUS_STALENESS          = var.staleness == null ? "none" : tostring(var.staleness)
    NUM_PARTITIONS             = tostring(var.graph_server_count)
    NUM_SHARDS                 = tostring(var.param_server_count)
  }
}
