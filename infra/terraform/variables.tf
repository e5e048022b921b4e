# ---------------------------------------------------------------------------------------------------------------------
# General
# ---------------------------------------------------------------------------------------------------------------------

variable "region" {
  type        = string
  description = "AWS region to deploy into, e.g. us-east-1. The account comes from the provider's credentials."

  validation {
    condition     = can(regex("^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-[0-9]+$", var.region))
    error_message = "The region must look like an AWS region name, e.g. us-east-1 or eu-west-2."
  }
}

variable "name" {
  type        = string
  description = "Name of this deployment; prefixes every resource name (bucket, function, groups, log groups)."
  default     = "dorylus"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,22}[a-z0-9]$", var.name))
    error_message = "The name must be 3-24 characters of lower-case letters, digits and hyphens, starting with a letter."
  }
}

variable "tags" {
  type        = map(string)
  description = "Extra tags added to every resource (through the provider's default_tags)."
  default     = {}
}

variable "log_retention_days" {
  type        = number
  description = "Retention in days of every CloudWatch log group (Lambda, servers, MSK brokers, VPC flow logs)."
  default     = 365

  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "The retention must be a CloudWatch Logs retention value of at least one year (365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288 or 3653)."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------------------------

variable "vpc_cidr" {
  type        = string
  description = "CIDR block of the VPC. Private subnets are /20s carved from it, one per availability zone."
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrnetmask(var.vpc_cidr)) && tonumber(split("/", var.vpc_cidr)[1]) <= 20
    error_message = "The VPC CIDR must be a valid IPv4 CIDR block of size /20 or larger."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones of the private subnets (one /20 subnet each), e.g. [\"us-east-1a\", \"us-east-1b\"]. MSK needs 2 or 3. Named explicitly so the deployment never spreads to a zone AWS adds later."

  validation {
    condition     = contains([2, 3], length(var.availability_zones)) && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "Give 2 or 3 distinct availability zones."
  }

  validation {
    condition     = alltrue([for z in var.availability_zones : startswith(z, var.region)])
    error_message = "Every availability zone must be in the deployment's region."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------------------------------------------------

variable "create_msk" {
  type        = bool
  description = "Create an Amazon MSK cluster (true) or use an existing Kafka cluster given by existing_kafka_bootstrap (false)."
  default     = true
}

variable "existing_kafka_bootstrap" {
  type        = string
  description = "Bootstrap brokers (host:port,host:port) of an existing Kafka cluster; used only when create_msk is false."
  default     = ""

  validation {
    condition     = var.create_msk || can(regex("^[A-Za-z0-9.-]+:[0-9]+(,[A-Za-z0-9.-]+:[0-9]+)*$", var.existing_kafka_bootstrap))
    error_message = "When create_msk is false, existing_kafka_bootstrap must be a comma-separated list of host:port."
  }
}

variable "existing_kafka_cidr_blocks" {
  type        = list(string)
  description = "CIDR blocks of an existing Kafka cluster's brokers; the servers and Lambdas may open connections to them on kafka_ports. Used only when create_msk is false."
  default     = []

  validation {
    condition     = alltrue([for c in var.existing_kafka_cidr_blocks : can(cidrnetmask(c)) && c != "0.0.0.0/0"])
    error_message = "Every entry must be a valid IPv4 CIDR block, and 0.0.0.0/0 is not allowed."
  }
}

variable "existing_msk_cluster_arn" {
  type        = string
  description = "ARN of an existing MSK cluster that uses IAM auth; scopes the kafka-cluster IAM permissions when create_msk is false. Leave empty for a non-MSK cluster (SASL/SCRAM credentials then come from the config file)."
  default     = ""

  validation {
    condition     = var.existing_msk_cluster_arn == "" || can(regex("^arn:[a-z-]+:kafka:[a-z0-9-]+:[0-9]{12}:cluster/[^/]+/[^/]+$", var.existing_msk_cluster_arn))
    error_message = "The cluster ARN must look like arn:aws:kafka:REGION:ACCOUNT:cluster/NAME/UUID."
  }
}

variable "kafka_auth" {
  type        = string
  description = "Client authentication of the Kafka cluster: \"iam\" (MSK IAM, port 9098) or \"scram\" (SASL/SCRAM over TLS, port 9096). Both run over TLS."
  default     = "iam"

  validation {
    condition     = contains(["iam", "scram"], var.kafka_auth)
    error_message = "The Kafka auth must be \"iam\" or \"scram\"."
  }
}

variable "kafka_ports" {
  type        = list(number)
  description = "Kafka ports the roles may connect to. Empty means derived from kafka_auth (9098 for iam, 9096 for scram)."
  default     = []

  validation {
    condition     = alltrue([for p in var.kafka_ports : contains([9092, 9094, 9096, 9098], p)])
    error_message = "Kafka ports must be among 9092, 9094, 9096 and 9098."
  }
}

variable "kafka_version" {
  type        = string
  description = "Apache Kafka version of the MSK cluster."
  default     = "3.6.0"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+(\\.tiered)?$", var.kafka_version))
    error_message = "The Kafka version must look like 3.6.0."
  }
}

variable "kafka_broker_instance_type" {
  type        = string
  description = "MSK broker instance type."
  default     = "kafka.m5.large"

  validation {
    condition     = can(regex("^kafka\\.[a-z0-9]+\\.[a-z0-9]+$", var.kafka_broker_instance_type))
    error_message = "The broker instance type must look like kafka.m5.large."
  }
}

variable "kafka_broker_count" {
  type        = number
  description = "Number of MSK broker nodes; a multiple of the number of availability zones."
  default     = 2

  validation {
    condition     = var.kafka_broker_count >= 2 && var.kafka_broker_count <= 30 && var.kafka_broker_count % length(var.availability_zones) == 0
    error_message = "The broker count must be between 2 and 30 and a multiple of the number of availability zones."
  }
}

variable "kafka_broker_volume_gb" {
  type        = number
  description = "EBS volume size in GiB of each MSK broker."
  default     = 100

  validation {
    condition     = var.kafka_broker_volume_gb >= 1 && var.kafka_broker_volume_gb <= 16384
    error_message = "The broker volume must be between 1 and 16384 GiB."
  }
}

variable "msk_scram_secret_arns" {
  type        = list(string)
  description = "Secrets Manager secrets with SASL/SCRAM credentials when kafka_auth is \"scram\": associated with the MSK cluster it creates (names must start with AmazonMSK_ and the secrets be encrypted with a customer-managed key, e.g. this deployment's kms_key_arn), and readable by the servers and the Lambdas (the first one is handed to them as DORYLUS_KAFKA_SECRET_ARN)."
  default     = []

  validation {
    condition     = alltrue([for a in var.msk_scram_secret_arns : can(regex("^arn:[a-z-]+:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:.+$", a))])
    error_message = "Every SCRAM secret must be a Secrets Manager secret ARN."
  }
}

variable "kafka_topic_prefix" {
  type        = string
  description = "Prefix of every Kafka topic and consumer group of this deployment; IAM permissions are scoped to it."
  default     = "dorylus."

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]{1,64}$", var.kafka_topic_prefix))
    error_message = "The topic prefix must be 1-64 characters of letters, digits, '.', '_' and '-'."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Tensor workers (AWS Lambda)
# ---------------------------------------------------------------------------------------------------------------------

variable "lambda_image_tag" {
  type        = string
  description = "Tag of the tensor-worker image in the deployment's ECR repository (tags are immutable: use the git commit)."

  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", var.lambda_image_tag)) && var.lambda_image_tag != "latest"
    error_message = "The image tag must be a valid Docker tag other than \"latest\"."
  }
}

variable "lambda_image_uri" {
  type        = string
  description = "Full image URI (repo@sha256:digest or repo:tag) to use instead of the deployment's ECR repository and lambda_image_tag. Empty uses the repository."
  default     = ""

  validation {
    condition     = var.lambda_image_uri == "" || can(regex("^[0-9]{12}\\.dkr\\.ecr\\.[a-z0-9-]+\\.amazonaws\\.com(\\.cn)?/[a-z0-9._/-]+(:[A-Za-z0-9_.-]+|@sha256:[0-9a-f]{64})$", var.lambda_image_uri))
    error_message = "The image URI must be an ECR image, ACCOUNT.dkr.ecr.REGION.amazonaws.com/REPO:TAG or @sha256:DIGEST."
  }
}

variable "lambda_architecture" {
  type        = string
  description = "Instruction set of the tensor-worker function and its image: x86_64 or arm64."
  default     = "x86_64"

  validation {
    condition     = contains(["x86_64", "arm64"], var.lambda_architecture)
    error_message = "The architecture must be x86_64 or arm64."
  }
}

variable "lambda_memory_mb" {
  type        = number
  description = "Memory of each tensor-worker Lambda in MB (CPU share scales with it)."
  default     = 2048

  validation {
    condition     = var.lambda_memory_mb >= 128 && var.lambda_memory_mb <= 10240 && floor(var.lambda_memory_mb) == var.lambda_memory_mb
    error_message = "Lambda memory must be a whole number of MB between 128 and 10240."
  }
}

variable "lambda_timeout_s" {
  type        = number
  description = "Timeout of one tensor-worker invocation in seconds."
  default     = 120

  validation {
    condition     = var.lambda_timeout_s >= 1 && var.lambda_timeout_s <= 900
    error_message = "The Lambda timeout must be between 1 and 900 seconds."
  }
}

variable "lambdas_per_graph_server" {
  type        = number
  description = "Concurrent tensor-worker Lambdas each graph server keeps in flight (Dorylus's Reddit run used 80)."
  default     = 80

  validation {
    condition     = var.lambdas_per_graph_server >= 1 && var.lambdas_per_graph_server <= 1000
    error_message = "Lambdas per graph server must be between 1 and 1000."
  }
}

variable "lambda_reserved_concurrency" {
  type        = number
  description = "Reserved concurrency of the tensor-worker function: at least graph_server_count x lambdas_per_graph_server, plus headroom for straggler relaunches (the default is 2 x 80 + 25%)."
  default     = 200

  validation {
    condition     = var.lambda_reserved_concurrency >= 1 && var.lambda_reserved_concurrency <= 10000 && floor(var.lambda_reserved_concurrency) == var.lambda_reserved_concurrency
    error_message = "Reserved concurrency must be a whole number between 1 and 10000."
  }

  validation {
    condition     = var.lambda_reserved_concurrency >= var.graph_server_count * var.lambdas_per_graph_server
    error_message = "Reserved concurrency must cover graph_server_count x lambdas_per_graph_server concurrent tensor workers."
  }
}

variable "lambda_s3_prefix" {
  type        = string
  description = "S3 key prefix, in the deployment bucket, that the tensor workers may read and write (spilled payloads)."
  default     = "tensor-workers/"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$", var.lambda_s3_prefix))
    error_message = "The prefix must be a relative S3 key prefix ending in '/'."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Graph servers and parameter servers (EC2)
# ---------------------------------------------------------------------------------------------------------------------

variable "graph_server_instance_type" {
  type        = string
  description = "EC2 instance type of the graph servers."
  default     = "c5.2xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.graph_server_instance_type))
    error_message = "The instance type must look like c5.2xlarge."
  }
}

variable "graph_server_count" {
  type        = number
  description = "Number of graph servers, which is also the number of graph partitions (one Auto Scaling group of size 1 per partition)."
  default     = 2

  validation {
    condition     = var.graph_server_count >= 1 && var.graph_server_count <= 256 && floor(var.graph_server_count) == var.graph_server_count
    error_message = "The graph server count must be a whole number between 1 and 256."
  }
}

variable "graph_server_volume_gb" {
  type        = number
  description = "Root EBS volume of each graph server in GiB (holds the container image and the partition's cache)."
  default     = 100

  validation {
    condition     = var.graph_server_volume_gb >= 30 && var.graph_server_volume_gb <= 16384
    error_message = "The graph server volume must be between 30 and 16384 GiB."
  }
}

variable "param_server_instance_type" {
  type        = string
  description = "EC2 instance type of the parameter servers."
  default     = "c5.xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.param_server_instance_type))
    error_message = "The instance type must look like c5.xlarge."
  }
}

variable "param_server_count" {
  type        = number
  description = "Number of parameter servers, one Auto Scaling group of size 1 each. Must be 1: the engine has one parameter server per run (weights are not sharded), and a second one would publish competing weight versions on the same topics."
  default     = 1

  validation {
    condition     = var.param_server_count == 1
    error_message = "The parameter server count must be 1 (the engine does not shard weights)."
  }
}

variable "param_server_volume_gb" {
  type        = number
  description = "Root EBS volume of each parameter server in GiB."
  default     = 50

  validation {
    condition     = var.param_server_volume_gb >= 30 && var.param_server_volume_gb <= 16384
    error_message = "The parameter server volume must be between 30 and 16384 GiB."
  }
}

variable "ami_id" {
  type        = string
  description = "AMI of the servers. Empty means the latest AMI named by ami_ssm_parameter. The user data expects Amazon Linux 2023 (dnf, aws CLI)."
  default     = ""

  validation {
    condition     = var.ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "The AMI id must look like ami-0123456789abcdef0."
  }
}

variable "ami_ssm_parameter" {
  type        = string
  description = "SSM public parameter that names the servers' AMI when ami_id is empty."
  default     = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"

  validation {
    condition     = startswith(var.ami_ssm_parameter, "/")
    error_message = "The SSM parameter name must start with '/'."
  }
}

# The command lines: `dorylus deploy render --config CONFIG` renders them (and the values below that the config
# decides) from the engine's own launcher (pipelines.launch.role_commands), so that a deployed cluster runs exactly
# what `dorylus train --transport kafka --spawn-local` runs on one machine. The defaults are its rendering; every one
# reads /etc/dorylus/config.toml and expands $PARTITION, $NUM_PARTITIONS, $DORYLUS_BOOTSTRAP and $DORYLUS_RUN_ID at
# run time from /etc/dorylus/env.

variable "graph_server_command" {
  type        = string
  description = "Command line of the graph server on each graph-server instance (its own container and systemd unit). Shell variables from /etc/dorylus/env ($PARTITION, $NUM_PARTITIONS, $DORYLUS_BOOTSTRAP, $DORYLUS_RUN_ID, ...) are expanded at run time. `dorylus deploy render` generates it from the engine's config."
  default     = "dorylus graph-server --partition \"$PARTITION\" --config /etc/dorylus/config.toml --bootstrap \"$DORYLUS_BOOTSTRAP\" --run-id \"$DORYLUS_RUN_ID\" --out \"/var/lib/dorylus/runs/$DORYLUS_RUN_ID\""

  validation {
    condition     = startswith(trimspace(var.graph_server_command), "dorylus ") && !strcontains(var.graph_server_command, "\n")
    error_message = "The graph server command must be one line that starts with \"dorylus \"."
  }
}

variable "tensor_worker_command" {
  type        = string
  description = "Command line of the tensor-worker process that runs beside the graph server on each graph-server instance (its own container and systemd unit): it takes that server's tensor tasks from Kafka and runs them on the Lambda function (or a local pool, as the config says). Empty runs none. `dorylus deploy render` generates it."
  default     = "dorylus tensor-worker --worker-id \"$PARTITION\" --workers \"$NUM_PARTITIONS\" --config /etc/dorylus/config.toml --bootstrap \"$DORYLUS_BOOTSTRAP\" --run-id \"$DORYLUS_RUN_ID\" --out \"/var/lib/dorylus/runs/$DORYLUS_RUN_ID\""

  validation {
    condition     = var.tensor_worker_command == "" || (startswith(trimspace(var.tensor_worker_command), "dorylus ") && !strcontains(var.tensor_worker_command, "\n"))
    error_message = "The tensor worker command must be empty or one line that starts with \"dorylus \"."
  }
}

variable "param_server_command" {
  type        = string
  description = "Command line of the parameter server on the parameter-server instance ($DORYLUS_BOOTSTRAP, $DORYLUS_RUN_ID, ... expand at run time). `dorylus deploy render` generates it from the engine's config."
  default     = "dorylus param-server --config /etc/dorylus/config.toml --bootstrap \"$DORYLUS_BOOTSTRAP\" --run-id \"$DORYLUS_RUN_ID\" --out \"/var/lib/dorylus/runs/$DORYLUS_RUN_ID\""

  validation {
    condition     = startswith(trimspace(var.param_server_command), "dorylus ") && !strcontains(var.param_server_command, "\n")
    error_message = "The parameter server command must be one line that starts with \"dorylus \"."
  }
}

variable "driver_command" {
  type        = string
  description = "Command line of the run's driver, beside the parameter server on its instance (its own container and systemd unit): `dorylus train --transport kafka` without --spawn-local, which evaluates every epoch, writes the run directory (uploaded to runs_prefix) and stops the roles at the end. Empty runs none (run the driver elsewhere in the VPC). `dorylus deploy render` generates it."
  default     = "dorylus train --config /etc/dorylus/config.toml --transport kafka --bootstrap \"$DORYLUS_BOOTSTRAP\" --run-id \"$DORYLUS_RUN_ID\" --worker-processes \"$NUM_PARTITIONS\" --out \"/var/lib/dorylus/runs/$DORYLUS_RUN_ID\" --overwrite --quiet"

  validation {
    condition     = var.driver_command == "" || (startswith(trimspace(var.driver_command), "dorylus ") && !strcontains(var.driver_command, "\n"))
    error_message = "The driver command must be empty or one line that starts with \"dorylus \"."
  }
}

variable "run_id" {
  type        = string
  description = "Run id handed to every server as DORYLUS_RUN_ID: it names the run's Kafka topics (<kafka_topic_prefix><run_id>.<kind>) and its directory under runs_prefix. `dorylus deploy render` derives one from the config; a new run (same config or not) needs a new id."
  default     = "dorylus"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", var.run_id))
    error_message = "The run id must be 1-64 letters, digits, '-' and '_', starting with a letter or digit."
  }
}

variable "config_s3_key" {
  type        = string
  description = "Key, in the deployment bucket, of the engine config that every server copies to /etc/dorylus/config.toml before it starts."
  default     = "config/config.toml"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()/-]+\\.toml$", var.config_s3_key)) && !startswith(var.config_s3_key, "/")
    error_message = "The config key must be a relative S3 key ending in .toml."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------

variable "staleness" {
  type        = number
  description = "Bounded staleness S handed to the servers as DORYLUS_STALENESS: a gather may read ghost values at most S epochs old. Null means fully synchronous."
  default     = 0

  validation {
    condition     = var.staleness == null || try(var.staleness >= 0 && var.staleness <= 64 && floor(var.staleness) == var.staleness, false)
    error_message = "The staleness must be null or a whole number between 0 and 64."
  }
}

variable "dataset_uri" {
  type        = string
  description = "Where the prepared dataset lives: s3://bucket/prefix/ for another bucket (read-only access is granted), or a relative prefix such as datasets/reddit/ inside the deployment bucket."
  default     = "datasets/"

  validation {
    condition     = can(regex("^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\\s]*)?|[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/)$", var.dataset_uri))
    error_message = "The dataset location must be s3://bucket[/prefix] or a relative prefix ending in '/'."
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------------------------------------

variable "runs_prefix" {
  type        = string
  description = "Key prefix of run artifacts (checkpoints, metrics, logs) in the deployment bucket; the lifecycle rule expires objects under it."
  default     = "runs/"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$", var.runs_prefix))
    error_message = "The runs prefix must be a relative S3 key prefix ending in '/'."
  }
}

variable "run_artifact_expiration_days" {
  type        = number
  description = "Days after which run artifacts under runs_prefix expire."
  default     = 90

  validation {
    condition     = var.run_artifact_expiration_days >= 1 && var.run_artifact_expiration_days <= 3650
    error_message = "The expiration must be between 1 and 3650 days."
  }
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Days after which non-current object versions in the deployment bucket expire."
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && var.noncurrent_version_expiration_days <= 3650
    error_message = "The non-current version expiration must be between 1 and 3650 days."
  }
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete the buckets even when they hold objects (all versions), and the ECR repository with its images. Keep false outside throw-away deployments."
  default     = false
}
