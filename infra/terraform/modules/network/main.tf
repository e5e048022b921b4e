# VPC with private subnets only. There is no internet or NAT gateway: AWS APIs are reached through VPC endpoints
# (S3 through a gateway endpoint, ECR, CloudWatch Logs and Lambda through interface endpoints).
#
# Security groups, all ingress from other security groups of this VPC only:
#   msk        <- graph servers, parameter servers, Lambdas on the Kafka port(s) of the chosen auth
#   endpoints  <- graph servers, parameter servers, Lambdas on 443
#   graph / param servers, Lambdas: no ingress at all; egress only to MSK, the endpoints and the S3 prefix list.

data "aws_region" "current" {}

# Pinned to the zones named by the caller; the precondition below fails the plan if one of them is not available.
data "aws_availability_zones" "selected" {
  state = "available"
  filter {
    name   = "zone-name"
    values = var.availability_zones
  }
}

locals {
  azs = var.availability_zones

  client_sgs = {
    graph_server = aws_security_group.graph_server.id
    param_server = aws_security_group.param_server.id
    lambda       = aws_security_group.lambda.id
  }

  # (client role, kafka port) pairs
  kafka_access = {
    for pair in setproduct(keys(local.client_sgs), var.kafka_ports) : "${pair[0]}-${pair[1]}" => {
      role = pair[0]
      port = pair[1]
    }
  }

  # (client role, existing broker CIDR, kafka port) triples
  existing_kafka_access = var.create_msk ? {} : {
    for t in setproduct(keys(local.client_sgs), var.existing_kafka_cidr_blocks, var.kafka_ports) : "${t[0]}-${t[1]}-${t[2]}" => {
      role = t[0]
      cidr = t[1]
      port = t[2]
    }
  }
}

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = {
    Name = var.name
  }
}

# Lock down the default security group: no rules at all.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id

  tags = {
    Name = "${var.name}-default-unused"
  }
}

resource "aws_subnet" "private" {
  count = length(var.availability_zones)

  vpc_id                  = aws_vpc.this.id
  availability_zone       = local.azs[count.index]
  cidr_block              = cidrsubnet(var.vpc_cidr, 20 - tonumber(split("/", var.vpc_cidr)[1]), count.index)
  map_public_ip_on_launch = false

  lifecycle {
    precondition {
      condition     = length(data.aws_availability_zones.selected.names) == length(var.availability_zones)
      error_message = "Not every zone of availability_zones is available in this region and account."
    }
  }

  tags = {
    Name = "${var.name}-private-${local.azs[count.index]}"
    Tier = "private"
  }
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id

  tags = {
    Name = "${var.name}-private"
  }
}

resource "aws_route_table_association" "private" {
  count = length(var.availability_zones)

  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private.id
}

# ---------------------------------------------------------------------------------------------------------------------
# VPC endpoints
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_vpc_endpoint" "s3" {
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${data.aws_region.current.name}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]

  tags = {
    Name = "${var.name}-s3"
  }
}

resource "aws_vpc_endpoint" "interface" {
  for_each = toset(var.interface_endpoint_services)

  vpc_id              = aws_vpc.this.id
  service_name        = "com.amazonaws.${data.aws_region.current.name}.${each.value}"
  vpc_endpoint_type   = "Interface"
  subnet_ids          = aws_subnet.private[*].id
  security_group_ids  = [aws_security_group.endpoints.id]
  private_dns_enabled = true

  tags = {
    Name = "${var.name}-${each.value}"
  }
}

# ---------------------------------------------------------------------------------------------------------------------
# Security groups
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_security_group" "graph_server" {
  #checkov:skip=CKV2_AWS_5:Attached in another module (modules/compute: aws_launch_template.server vpc_security_group_ids); checkov's graph does not follow security-group ids passed through module outputs and inputs.
  name        = "${var.name}-graph-server"
  description = "Dorylus graph servers: no inbound; outbound to Kafka, VPC endpoints and S3 only"
  vpc_id      = aws_vpc.this.id

  tags = {
    Name = "${var.name}-graph-server"
  }
}

resource "aws_security_group" "param_server" {
  #checkov:skip=CKV2_AWS_5:Attached in another module (modules/compute: aws_launch_template.server vpc_security_group_ids); checkov's graph does not follow security-group ids passed through module outputs and inputs.
  name        = "${var.name}-param-server"
  description = "Dorylus parameter servers: no inbound; outbound to Kafka, VPC endpoints and S3 only"
  vpc_id      = aws_vpc.this.id

  tags = {
    Name = "${var.name}-param-server"
  }
}

resource "aws_security_group" "lambda" {
  #checkov:skip=CKV2_AWS_5:Attached in another module (modules/tensor_workers: aws_lambda_function.this vpc_config); checkov's graph does not follow security-group ids passed through module outputs and inputs.
  name        = "${var.name}-tensor-workers"
  description = "Dorylus tensor-worker Lambdas: no inbound; outbound to Kafka, VPC endpoints and S3 only"
  vpc_id      = aws_vpc.this.id

  tags = {
    Name = "${var.name}-tensor-workers"
  }
}

resource "aws_security_group" "msk" {
  #checkov:skip=CKV2_AWS_5:Attached in another module (modules/kafka: aws_msk_cluster.this broker_node_group_info); checkov's graph does not follow security-group ids passed through module outputs and inputs.
  count = var.create_msk ? 1 : 0

  name        = "${var.name}-msk"
  description = "Dorylus MSK brokers: Kafka ports from the Dorylus roles only"
  vpc_id      = aws_vpc.this.id

  tags = {
    Name = "${var.name}-msk"
  }
}

resource "aws_security_group" "endpoints" {
  name        = "${var.name}-vpc-endpoints"
  description = "Interface VPC endpoints: HTTPS from the Dorylus roles only"
  vpc_id      = aws_vpc.this.id

  tags = {
    Name = "${var.name}-vpc-endpoints"
  }
}

# Kafka: role -> MSK
resource "aws_vpc_security_group_ingress_rule" "msk_from_roles" {
  for_each = var.create_msk ? local.kafka_access : {}

  security_group_id            = aws_security_group.msk[0].id
  description                  = "Kafka ${each.value.port} from ${each.value.role}"
  referenced_security_group_id = local.client_sgs[each.value.role]
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
}

resource "aws_vpc_security_group_egress_rule" "roles_to_msk" {
  for_each = var.create_msk ? local.kafka_access : {}

  security_group_id            = local.client_sgs[each.value.role]
  description                  = "Kafka ${each.value.port} to the MSK brokers"
  referenced_security_group_id = aws_security_group.msk[0].id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
}

resource "aws_vpc_security_group_egress_rule" "roles_to_existing_kafka" {
  for_each = local.existing_kafka_access

  security_group_id = local.client_sgs[each.value.role]
  description       = "Kafka ${each.value.port} to the existing brokers in ${each.value.cidr}"
  cidr_ipv4         = each.value.cidr
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
}

# HTTPS: role -> interface endpoints
resource "aws_vpc_security_group_ingress_rule" "endpoints_from_roles" {
  for_each = local.client_sgs

  security_group_id            = aws_security_group.endpoints.id
  description                  = "HTTPS from ${each.key}"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = 443
  to_port                      = 443
}

resource "aws_vpc_security_group_egress_rule" "roles_to_endpoints" {
  for_each = local.client_sgs

  security_group_id            = each.value
  description                  = "HTTPS to the interface VPC endpoints"
  referenced_security_group_id = aws_security_group.endpoints.id
  ip_protocol                  = "tcp"
  from_port                    = 443
  to_port                      = 443
}

# HTTPS: role -> S3 (gateway endpoint prefix list)
resource "aws_vpc_security_group_egress_rule" "roles_to_s3" {
  for_each = local.client_sgs

  security_group_id = each.value
  description       = "HTTPS to S3 through the gateway endpoint"
  prefix_list_id    = aws_vpc_endpoint.s3.prefix_list_id
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
}

# ---------------------------------------------------------------------------------------------------------------------
# VPC flow logs
# ---------------------------------------------------------------------------------------------------------------------

resource "aws_cloudwatch_log_group" "flow_logs" {
  name              = "/dorylus/${var.name}/vpc-flow-logs"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
}

data "aws_iam_policy_document" "flow_logs_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["vpc-flow-logs.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "flow_logs" {
  name_prefix        = "${var.name}-flow-logs-"
  assume_role_policy = data.aws_iam_policy_document.flow_logs_assume.json
}

data "aws_iam_policy_document" "flow_logs" {
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.flow_logs.arn}:*"]
  }
}

resource "aws_iam_role_policy" "flow_logs" {
  name   = "write-flow-logs"
  role   = aws_iam_role.flow_logs.id
  policy = data.aws_iam_policy_document.flow_logs.json
}

resource "aws_flow_log" "this" {
  vpc_id          = aws_vpc.this.id
  traffic_type    = "ALL"
  log_destination = aws_cloudwatch_log_group.flow_logs.arn
  iam_role_arn    = aws_iam_role.flow_logs.arn
}
