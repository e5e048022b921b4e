output "bootstrap_brokers" {
  description = "Bootstrap brokers for the configured auth (TLS), or the existing cluster's bootstrap string."
  value = (var.create
    ? (var.auth == "iam" ? aws_msk_cluster.this[0].bootstrap_brokers_sasl_iam : aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram)
    : var.existing_bootstrap
  )
}

output "cluster_arn" {
  description = "ARN of the MSK cluster (created or existing); empty for a non-MSK existing cluster."
  value       = var.create ? aws_msk_cluster.this[0].arn : var.existing_cluster_arn
}

output "cluster_name" {
  description = "Name of the created MSK cluster (empty when an existing cluster is used)."
  value       = var.create ? aws_msk_cluster.this[0].cluster_name : ""
}
