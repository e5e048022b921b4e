variable "name" {
  type        = string
  description = "Deployment name; prefixes resource names."
}

variable "vpc_cidr" {
  type        = string
  description = "CIDR block of the VPC."
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones, one private subnet in each."
}

variable "kafka_ports" {
  type        = list(number)
  description = "Kafka broker ports that graph servers, parameter servers and Lambdas may connect to."
}

variable "create_msk" {
  type        = bool
  description = "Whether an MSK cluster is created in this VPC (its security group then admits the roles on kafka_ports)."
}

variable "existing_kafka_cidr_blocks" {
  type        = list(string)
  description = "CIDR blocks of an existing Kafka cluster's brokers, reachable on kafka_ports when create_msk is false."
  default     = []
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the flow-log group."
}

variable "log_retention_days" {
  type        = number
  description = "Retention of the VPC flow-log group in days."
}

variable "interface_endpoint_services" {
  type        = list(string)
  description = "AWS services reached through interface VPC endpoints from the private subnets (there is no NAT gateway)."
  default     = ["ecr.api", "ecr.dkr", "logs", "lambda"]
}
