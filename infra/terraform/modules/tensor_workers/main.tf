# Tensor workers: the container-image Lambda built from infra/lambda/Dockerfile, its ECR repository, log group and a
# least-privilege execution role (its log group, its S3 prefix, its Kafka topics, its VPC network interfaces).

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  account_id    = data.aws_caller_identity.current.account_id
  partition     = data.aws_partition.current.partition
  region        = data.aws_region.current.name
  function_name = "${var.name}-tensor-worker"
  image_uri     = var.image_uri != "" ? var.image_uri : "${aws_ecr_repository.this.repository_url}:${var.image_tag}"

  msk_enabled = var.msk_cluster_arn != ""
  # arn:aws:kafka:REGION:ACCOUNT:cluster/NAME/UUID -> topic/NAME/UUID/PREFIX*, group/NAME/UUID/PREFIX*
  msk_topic_arn = "${replace(var.msk_cluster_arn, ":cluster/", ":topic/")}/${var.kafka_topic_prefix}*"
  msk_group_arn = "${replace(var.msk_cluster_arn, ":cluster/", ":group/")}/${var.kafka_topic_prefix}*"
}

# ---------------------------------------------------------------------------------------------------------------------
# ECR repository of the project image (shared with the servers, which run the same image).
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_ecr_repository" "this" {
  name                 = var.name
  image_tag_mutability = "IMMUTABLE"
  force_delete         = var.force_delete

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = var.kms_key_arn
  }
}

resource "aws_ecr_lifecycle_policy" "this" {
  repository = aws_ecr_repository.this.name

  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Keep the last ${var.image_retention_count} images"
      selection = {
        tagStatus   = "any"
        countType   = "imageCountMoreThan"
        countNumber = var.image_retention_count
      }
      action = { type = "expire" }
    }]
  })
}

data "aws_iam_policy_document" "ecr" {
  statement {
    sid     = "LambdaImagePull"
    effect  = "Allow"
    actions = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
    condition {
      test     = "StringLike"
      variable = "aws:sourceArn"
      values   = ["arn:${local.partition}:lambda:${local.region}:${local.account_id}:function:${local.function_name}"]
    }
  }
}

resource "aws_ecr_repository_policy" "this" {
  repository = aws_ecr_repository.this.name
  policy     = data.aws_iam_policy_document.ecr.json
}

# ---------------------------------------------------------------------------------------------------------------------
# Execution role
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_cloudwatch_log_group" "this" {
  name              = "/aws/lambda/${local.function_name}"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-tensor-worker-"
  description        = "Execution role of the Dorylus tensor-worker Lambda"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

data "aws_iam_policy_document" "this" {
  statement {
    sid       = "OwnLogGroup"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.this.arn}:*"]
  }

  # Network interfaces in the function's own subnets and security group (Lambda VPC access).
  statement {
    sid     = "VpcNetworkInterfaces"
    actions = ["ec2:CreateNetworkInterface"]
    resources = concat(
      ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:network-interface/*"],
      [for s in var.subnet_ids : "arn:${local.partition}:ec2:${local.region}:${local.account_id}:subnet/${s}"],
      ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:security-group/${var.security_group_id}"],
    )
  }

  statement {
    sid = "VpcNetworkInterfaceLifecycle"
    actions = [
      "ec2:DeleteNetworkInterface",
      "ec2:AssignPrivateIpAddresses",
      "ec2:UnassignPrivateIpAddresses",
    ]
    resources = ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:network-interface/*"]
  }

  # Describe* calls cannot be scoped to resources; restrict them to this region.
  statement {
    sid       = "VpcDescribe"
    actions   = ["ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [local.region]
    }
  }

  statement {
    sid       = "XRayTraces"
    actions   = ["xray:PutTraceSegments", "xray:PutTelemetryRecords"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [local.region]
    }
  }

  statement {
    sid       = "OwnPrefixObjects"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    resources = ["${var.bucket_arn}/${var.s3_prefix}*"]
  }

  statement {
    sid       = "OwnPrefixList"
    actions   = ["s3:ListBucket"]
    resources = [var.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.s3_prefix}*"]
    }
  }

  statement {
    sid       = "BucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]
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
      sid       = "KafkaOwnTopics"
      actions   = ["kafka-cluster:DescribeTopic", "kafka-cluster:ReadData", "kafka-cluster:WriteData"]
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

resource "aws_iam_role_policy" "this" {
  name   = "tensor-worker"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.this.json
}

# ---------------------------------------------------------------------------------------------------------------------
# Function
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_lambda_function" "this" {
  #checkov:skip=CKV_AWS_116:Graph servers invoke the tensor workers synchronously (RequestResponse) and relaunch stragglers and failures themselves; a DLQ only receives failed asynchronous invocations, which never happen here.
  #checkov:skip=CKV_AWS_272:Lambda code signing applies only to .zip packages; this is a container image, whose integrity comes from the immutable, scanned, KMS-encrypted ECR repository.
  function_name                  = local.function_name
  description                    = "Dorylus tensor worker (AV/AE tasks), image built from infra/lambda/Dockerfile"
  role                           = aws_iam_role.this.arn
  package_type                   = "Image"
  image_uri                      = local.image_uri
  architectures                  = [var.architecture]
  memory_size                    = var.memory_mb
  timeout                        = var.timeout_s
  reserved_concurrent_executions = var.reserved_concurrency
  kms_key_arn                    = var.kms_key_arn

  vpc_config {
    subnet_ids         = var.subnet_ids
    security_group_ids = [var.security_group_id]
  }

  tracing_config {
    mode = "Active"
  }

  logging_config {
    log_format = "JSON"
    log_group  = aws_cloudwatch_log_group.this.name
  }

  environment {
    variables = {
      DORYLUS_BUCKET           = var.bucket_name
      DORYLUS_S3_PREFIX        = var.s3_prefix
      DORYLUS_BOOTSTRAP        = var.kafka_bootstrap
      DORYLUS_KAFKA_AUTH       = var.kafka_auth
      DORYLUS_TOPIC_PREFIX     = var.kafka_topic_prefix
      DORYLUS_KAFKA_SECRET_ARN = try(var.kafka_secret_arns[0], "")
    }
  }

  depends_on = [
    aws_iam_role_policy.this,
    aws_cloudwatch_log_group.this,
    aws_ecr_repository_policy.this,
  ]
}
