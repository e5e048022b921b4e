output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "private_subnet_ids" {
  description = "IDs of the private subnets, one per availability zone."
  value       = aws_subnet.private[*].id
}

output "graph_server_security_group_id" {
  description = "Security group of the graph servers."
  value       = aws_security_group.graph_server.id
}

output "param_server_security_group_id" {
  description = "Security group of the parameter servers."
  value       = aws_security_group.param_server.id
}

output "lambda_security_group_id" {
  description = "Security group of the tensor-worker Lambdas."
  value       = aws_security_group.lambda.id
}

output "msk_security_group_id" {
  description = "Security group of the MSK brokers (null when no MSK cluster is created)."
  value       = one(aws_security_group.msk[*].id)
}
