output "function_name" {
  description = "Name of the tensor-worker function."
  value       = aws_lambda_function.this.function_name
}

output "function_arn" {
  description = "ARN of the tensor-worker function."
  value       = aws_lambda_function.this.arn
}

output "role_arn" {
  description = "ARN of the function's execution role."
  value       = aws_iam_role.this.arn
}

output "ecr_repository_url" {
  description = "URL of the ECR repository of the project image."
  value       = aws_ecr_repository.this.repository_url
}

output "ecr_repository_arn" {
  description = "ARN of the ECR repository of the project image."
  value       = aws_ecr_repository.this.arn
}

output "image_uri" {
  description = "Image URI the function (and the servers) run."
  value       = local.image_uri
}

output "log_group_name" {
  description = "Log group of the function."
  value       = aws_cloudwatch_log_group.this.name
}
