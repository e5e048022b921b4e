# Dorylus's Reddit run: 2 graph servers (c5.2xlarge), 80 tensor-worker Lambdas each, one parameter server.
#
#   terraform plan -var-file=examples/reddit.tfvars -var lambda_image_tag=$(git rev-parse --short=12 HEAD)
#
# The dataset is prepared beforehand (`dorylus prepare ...`, 2 partitions) and uploaded under datasets/reddit/ in the
# deployment bucket; the engine config goes to config/config.toml (see README.md).

region = "us-east-1"
name   = "dorylus-reddit"

tags = {
  Experiment = "reddit-gcn"
}

# Network and Kafka
availability_zones         = ["us-east-1a", "us-east-1b"]
kafka_auth                 = "iam"
kafka_broker_instance_type = "kafka.m5.large"
kafka_broker_count         = 2
kafka_broker_volume_gb     = 100

# Graph servers: one per partition
graph_server_instance_type = "c5.2xlarge"
graph_server_count         = 2
graph_server_volume_gb     = 100

# Parameter server
param_server_instance_type = "c5.xlarge"
param_server_count         = 1

# Tensor workers: 80 concurrent Lambdas per graph server; reserved concurrency 2 x 80 + 25% for straggler relaunches
lambdas_per_graph_server    = 80
lambda_reserved_concurrency = 200
lambda_memory_mb            = 2048
lambda_timeout_s            = 120
lambda_architecture         = "x86_64"

# Training: bounded staleness S = 0 (Dorylus's asynchronous variant that matches synchronous accuracy)
staleness   = 0
dataset_uri = "datasets/reddit/"

# Storage
runs_prefix                  = "runs/"
run_artifact_expiration_days = 90
log_retention_days           = 365
