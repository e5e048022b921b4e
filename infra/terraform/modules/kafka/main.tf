# Amazon MSK with TLS in transit and IAM or SASL/SCRAM client auth, or an existing cluster's bootstrap string.

locals {
  cluster_name = "${var.name}-kafka"
}

resource "aws_cloudwatch_log_group" "broker" {
  count = var.create ? 1 : 0

  name              = "/dorylus/${var.name}/msk-brokers"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
}

resource "aws_msk_configuration" "this" {
  count = var.create ? 1 : 0

  name           = "${local.cluster_name}-config"
  kafka_versions = [var.kafka_version]
  description    = "Dorylus ${var.name}: topics are created by the engine, replicated across AZs"

  server_properties = <<-PROPERTIES
    auto.create.topics.enable=false
    default.replication.factor=${min(var.broker_count, 3)}
    min.insync.replicas=${max(min(var.broker_count, 3) - 1, 1)}
    num.partitions=${var.default_partitions}
    message.max.bytes=10485760
    replica.fetch.max.bytes=10485760
    log.retention.hours=168
  PROPERTIES
}

resource "aws_msk_cluster" "this" {
  count = var.create ? 1 : 0

  cluster_name           = local.cluster_name
  kafka_version          = var.kafka_version
  number_of_broker_nodes = var.broker_count
  enhanced_monitoring    = "DEFAULT"

  broker_node_group_info {
    instance_type   = var.broker_instance_type
    client_subnets  = var.subnet_ids
    security_groups = [var.security_group_id]

    storage_info {
      ebs_storage_info {
        volume_size = var.broker_volume_gb
      }
    }

    connectivity_info {
      public_access {
        type = "DISABLED"
      }
    }
  }

  configuration_info {
    arn      = aws_msk_configuration.this[0].arn
    revision = aws_msk_configuration.this[0].latest_revision
  }

  client_authentication {
    unauthenticated = false

    sasl {
      iam   = var.auth == "iam"
      scram = var.auth == "scram"
    }
  }

  encryption_info {
    encryption_at_rest_kms_key_arn = var.kms_key_arn

    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }

  logging_info {
    broker_logs {
      cloudwatch_logs {
        enabled   = true
        log_group = aws_cloudwatch_log_group.broker[0].name
      }
    }
  }
}

resource "aws_msk_scram_secret_association" "this" {
  count = var.create && var.auth == "scram" && length(var.scram_secret_arns) > 0 ? 1 : 0

  cluster_arn     = aws_msk_cluster.this[0].arn
  secret_arn_list = var.scram_secret_arns

  lifecycle {
    precondition {
      condition     = alltrue([for a in var.scram_secret_arns : startswith(split(":", a)[6], "AmazonMSK_")])
      error_message = "MSK only accepts SCRAM secrets whose names start with AmazonMSK_."
    }
  }
}
