# Graph servers and parameter servers on EC2.
#
# Partition assignment: one launch template and one Auto Scaling group of size 1 per graph partition (and per
# parameter shard). The partition index is rendered into that launch template's user data, so an instance always knows
# its partition without any coordination, and when it fails its group replaces it with an instance of the same
# partition. Changing the command line creates a new launch-template version; the group picks it up for the next
# instance it launches (start an instance refresh, or terminate the instance, to apply it at once).
#
# Every server runs the project image (the same image as the tensor-worker Lambda) under Docker with the host network,
# as a systemd unit: `docker run ... IMAGE /bin/sh /etc/dorylus/run.sh`, where run.sh holds the command line. Side
# processes (the tensor worker beside each graph server, the driver beside the parameter server) run the same way in
# their own containers and units (dorylus-sidecar@<name>), each restarted on its own.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  region     = data.aws_region.current.name

  registry = split("/", var.image_uri)[0]

  msk_enabled   = var.msk_cluster_arn != ""
  msk_topic_arn = "${replace(var.msk_cluster_arn, ":cluster/", ":topic/")}/${var.kafka_topic_prefix}*"
  msk_group_arn = "${replace(var.msk_cluster_arn, ":cluster/", ":group/")}/${var.kafka_topic_prefix}*"

  roles = {
    graph_server = {
      title         = "graph server"
      count         = var.graph_server_count
      instance_type = var.graph_server_instance_type
      volume_gb     = var.graph_server_volume_gb
      sg_id         = var.graph_server_sg_id
      command       = var.graph_server_command
      index_var     = "PARTITION"
    }
    param_server = {
      title         = "parameter server"
      count         = var.param_server_count
      instance_type = var.param_server_instance_type
      volume_gb     = var.param_server_volume_gb
      sg_id         = var.param_server_sg_id
      command       = var.param_server_command
      index_var     = "SHARD"
    }
  }

  # Side processes of each role, by name (their own container and unit, dorylus-sidecar@<name>).
  sidecars = {
    graph_server = var.tensor_worker_command == "" ? {} : { "tensor-worker" = var.tensor_worker_command }
    param_server = var.driver_command == "" ? {} : { driver = var.driver_command }
  }

  # One entry per instance: graph_server-0, graph_server-1, ..., param_server-0, ...
  instances = merge([
    for role, r in local.roles : {
      for i in range(r.count) : "${role}-${i}" => merge(r, { role = role, index = i })
    }
  ]...)

  # Rendered user data of every instance (also an output, for `dorylus deploy render` and the tests).
  user_data = {
    for key, inst in local.instances : key => templatefile(var.user_data_template, {
      role        = replace(inst.role, "_", "-")
      title       = inst.title
      region      = local.region
      registry    = local.registry
      image_uri   = var.image_uri
      config_uri  = "s3://${var.bucket_name}/${var.config_s3_key}"
      log_group   = aws_cloudwatch_log_group.servers.name
      log_stream  = "${replace(inst.role, "_", "-")}-${inst.index}"
      command     = inst.command
      sidecars    = local.sidecars[inst.role]
      dataset_uri = "s3://${var.dataset_bucket}/${var.dataset_prefix}"
      runs_uri    = "s3://${var.bucket_name}/${var.runs_prefix}"
      environment = merge(var.environment, { (inst.index_var) = tostring(inst.index), DORYLUS_ROLE = replace(inst.role, "_", "-") })
    })
  }
}

resource "aws_cloudwatch_log_group" "servers" {
  name              = "/dorylus/${var.name}/servers"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
}

# ---------------------------------------------------------------------------------------------------------------------
# Instance roles
# ---------------------------------------------------------------------------------------------------------------------

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "server" {
  for_each = local.roles

  name_prefix        = "${var.name}-${replace(each.key, "_", "-")}-"
  description        = "Dorylus ${each.value.title} instances"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

resource "aws_iam_instance_profile" "server" {
  for_each = local.roles

  name_prefix = "${var.name}-${replace(each.key, "_", "-")}-"
  role        = aws_iam_role.server[each.key].name
}

data "aws_iam_policy_document" "server" {
  for_each = local.roles

  # ECR login cannot be scoped to a repository (AWS API limitation).
  statement {
    sid       = "EcrLogin"
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [local.region]
    }
  }

  statement {
    sid       = "EcrPull"
    actions   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
    resources = [var.ecr_repository_arn]
  }

  statement {
    sid       = "OwnLogGroup"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.servers.arn}:*"]
  }

  statement {
    sid       = "ReadConfig"
    actions   = ["s3:GetObject"]
    resources = ["${var.bucket_arn}/${var.config_s3_key}"]
  }

  statement {
    sid       = "ReadDataset"
    actions   = ["s3:GetObject"]
    resources = ["arn:${local.partition}:s3:::${var.dataset_bucket}/${var.dataset_prefix}*"]
  }

  statement {
    sid       = "ListDataset"
    actions   = ["s3:ListBucket"]
    resources = ["arn:${local.partition}:s3:::${var.dataset_bucket}"]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.dataset_prefix}*"]
    }
  }

  statement {
    sid       = "RunArtifacts"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    resources = ["${var.bucket_arn}/${var.runs_prefix}*"]
  }

  statement {
    sid       = "ListRunArtifacts"
    actions   = ["s3:ListBucket"]
    resources = [var.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.runs_prefix}*"]
    }
  }

  statement {
    sid       = "BucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]
  }

  dynamic "statement" {
    for_each = each.key == "graph_server" ? [1] : []
    content {
      sid       = "InvokeTensorWorkers"
      actions   = ["lambda:InvokeFunction"]
      resources = [var.lambda_function_arn, "${var.lambda_function_arn}:*"]
    }
  }

  dynamic "statement" {
    for_each = local.msk_enabled ? [1] : []
    content {
      sid       = "KafkaConnect"
      actions   = ["kafka-cluster:Connect", "kafka-cluster:DescribeCluster"]
      resources = [var.msk_cluster_arn]
    }
  }

  dynamic "statement" {
    for_each = local.msk_enabled ? [1] : []
    content {
      sid = "KafkaOwnTopics"
      actions = [
        "kafka-cluster:CreateTopic",
        "kafka-cluster:DescribeTopic",
        "kafka-cluster:DescribeTopicDynamicConfiguration",
        "kafka-cluster:ReadData",
        "kafka-cluster:WriteData",
      ]
      resources = [local.msk_topic_arn]
    }
  }

  dynamic "statement" {
    for_each = local.msk_enabled ? [1] : []
    content {
      sid       = "KafkaOwnGroups"
      actions   = ["kafka-cluster:DescribeGroup", "kafka-cluster:AlterGroup"]
      resources = [local.msk_group_arn]
    }
  }

  dynamic "statement" {
    for_each = length(var.kafka_secret_arns) > 0 ? [1] : []
    content {
      sid       = "KafkaScramCredentials"
      actions   = ["secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"]
      resources = var.kafka_secret_arns
    }
  }
}

resource "aws_iam_role_policy" "server" {
  for_each = local.roles

  name   = "dorylus-${replace(each.key, "_", "-")}"
  role   = aws_iam_role.server[each.key].id
  policy = data.aws_iam_policy_document.server[each.key].json
}

# ---------------------------------------------------------------------------------------------------------------------
# One launch template and one Auto Scaling group (min = max = desired = 1) per partition / shard
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_launch_template" "server" {
  for_each = local.instances

  name_prefix            = "${var.name}-${replace(each.key, "_", "-")}-"
  description            = "Dorylus ${each.value.title}, ${lower(each.value.index_var)} ${each.value.index}"
  image_id               = var.ami_id
  instance_type          = each.value.instance_type
  ebs_optimized          = true
  update_default_version = true
  vpc_security_group_ids = [each.value.sg_id]

  iam_instance_profile {
    arn = aws_iam_instance_profile.server[each.value.role].arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = each.value.volume_gb
      volume_type           = "gp3"
      encrypted             = true # with the account's aws/ebs key (see modules/storage)
      delete_on_termination = true
    }
  }

  user_data = base64encode(local.user_data[each.key])

  tag_specifications {
    resource_type = "volume"
    tags = {
      Name = "${var.name}-${replace(each.key, "_", "-")}"
    }
  }
}

resource "aws_autoscaling_group" "server" {
  for_each = local.instances

  name                      = "${var.name}-${replace(each.key, "_", "-")}"
  min_size                  = 1
  max_size                  = 1
  desired_capacity          = 1
  vpc_zone_identifier       = var.subnet_ids
  health_check_type         = "EC2"
  health_check_grace_period = 300
  default_cooldown          = 60
  termination_policies      = ["OldestInstance"]

  launch_template {
    id      = aws_launch_template.server[each.key].id
    version = aws_launch_template.server[each.key].latest_version
  }

  tag {
    key                 = "Name"
    value               = "${var.name}-${replace(each.key, "_", "-")}"
    propagate_at_launch = true
  }

  tag {
    key                 = "dorylus:role"
    value               = replace(each.value.role, "_", "-")
    propagate_at_launch = true
  }

  tag {
    key                 = "dorylus:${lower(each.value.index_var)}"
    value               = tostring(each.value.index)
    propagate_at_launch = true
  }

  depends_on = [aws_iam_role_policy.server]
}
