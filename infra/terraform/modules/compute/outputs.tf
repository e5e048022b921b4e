output "graph_server_group_names" {
  description = "Auto Scaling group names of the graph servers, in partition order."
  value       = [for i in range(var.graph_server_count) : aws_autoscaling_group.server["graph_server-${i}"].name]
}

output "param_server_group_names" {
  description = "Auto Scaling group names of the parameter servers, in shard order."
  value       = [for i in range(var.param_server_count) : aws_autoscaling_group.server["param_server-${i}"].name]
}

output "log_group_name" {
  description = "Log group of the server containers."
  value       = aws_cloudwatch_log_group.servers.name
}

output "graph_server_role_arn" {
  description = "IAM role of the graph servers."
  value       = aws_iam_role.server["graph_server"].arn
}

output "param_server_role_arn" {
  description = "IAM role of the parameter servers."
  value       = aws_iam_role.server["param_server"].arn
}

output "user_data" {
  description = "Rendered user data of every server, keyed by graph_server-<partition> and param_server-<shard>."
  value       = local.user_data
}
