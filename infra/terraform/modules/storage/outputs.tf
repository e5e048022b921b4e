output "kms_key_arn" {
  description = "ARN of the deployment's KMS key."
  value       = aws_kms_key.this.arn
}

output "bucket_name" {
  description = "Name of the deployment bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the deployment bucket."
  value       = aws_s3_bucket.this.arn
}

output "access_log_bucket_name" {
  description = "Name of the access-log bucket."
  value       = aws_s3_bucket.access_logs.id
}
