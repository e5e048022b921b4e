# `terraform test` without AWS: the aws provider is mocked, so this checks the wiring, the expressions, the
# templates and the validation blocks, not what AWS would accept. Run from infra/terraform after `terraform init`:
#   terraform test -var-file=examples/reddit.tfvars
# (tests/test_terraform.py runs it when a terraform binary and the aws provider are available.)

mock_provider "aws" {
  mock_data "aws_caller_identity" {
    defaults = {
      account_id = "123456789012"
    }
  }

  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }

  mock_data "aws_region" {
    defaults = {
      name = "us-east-1"
    }
  }

  mock_data "aws_availability_zones" {
    defaults = {
      names = ["us-east-1a", "us-east-1b"]
    }
  }

  mock_data "aws_ssm_parameter" {
    defaults = {
      value = "ami-0123456789abcdef0"
    }
  }

  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }

  mock_resource "aws_kms_key" {
    defaults = {
      arn = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
    }
  }

  mock_resource "aws_s3_bucket" {
    defaults = {
      arn = "arn:aws:s3:::dorylus-mock-bucket"
    }
  }

  mock_resource "aws_msk_cluster" {
    defaults = {
      arn                          = "arn:aws:kafka:us-east-1:123456789012:cluster/dorylus-reddit-kafka/11111111-2222-3333-4444-555555555555-1"
      bootstrap_brokers_sasl_iam   = "b-1.mock.kafka.us-east-1.amazonaws.com:9098,b-2.mock.kafka.us-east-1.amazonaws.com:9098"
      bootstrap_brokers_sasl_scram = "b-1.mock.kafka.us-east-1.amazonaws.com:9096,b-2.mock.kafka.us-east-1.amazonaws.com:9096"
    }
  }

  mock_resource "aws_ecr_repository" {
    defaults = {
      arn            = "arn:aws:ecr:us-east-1:123456789012:repository/dorylus-reddit"
      repository_url = "123456789012.dkr.ecr.us-east-1.amazonaws.com/dorylus-reddit"
    }
  }

  mock_resource "aws_lambda_function" {
    defaults = {
      arn = "arn:aws:lambda:us-east-1:123456789012:function:dorylus-reddit-tensor-worker"
    }
  }

  mock_resource "aws_iam_instance_profile" {
    defaults = {
      arn = "arn:aws:iam::123456789012:instance-profile/dorylus-mock"
    }
  }

  mock_resource "aws_iam_role" {
    defaults = {
      arn = "arn:aws:iam::123456789012:role/dorylus-mock"
    }
  }

  mock_resource "aws_cloudwatch_log_group" {
    defaults = {
      arn = "arn:aws:logs:us-east-1:123456789012:log-group:dorylus-mock"
    }
  }

  mock_resource "aws_launch_template" {
    defaults = {
      id             = "lt-0123456789abcdef0"
      latest_version = 1
    }
  }

  mock_resource "aws_msk_configuration" {
    defaults = {
      arn = "arn:aws:kafka:us-east-1:123456789012:configuration/dorylus-mock/1"
    }
  }
}

variables {
  lambda_image_tag = "0123456789ab"
}

run "reddit" {
  command = apply

  assert {
    condition     = length(output.graph_server_group_names) == 2 && length(output.param_server_group_names) == 1
    error_message = "The Reddit example must have 2 graph-server groups and 1 parameter-server group."
  }

  assert {
    condition     = output.lambda_reserved_concurrency >= 160
    error_message = "Reserved concurrency must cover 2 graph servers x 80 Lambdas."
  }

  assert {
    condition     = output.kafka_bootstrap_brokers == "b-1.mock.kafka.us-east-1.amazonaws.com:9098,b-2.mock.kafka.us-east-1.amazonaws.com:9098"
    error_message = "With IAM auth the bootstrap output must be the SASL/IAM brokers."
  }

  assert {
    condition     = output.image_uri == "123456789012.dkr.ecr.us-east-1.amazonaws.com/dorylus-reddit:0123456789ab"
    error_message = "The image URI must be the repository and the image tag."
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-1"], "\nPARTITION=1\n") && strcontains(module.compute.user_data["graph_server-1"], "exec dorylus graph-server --partition \"$PARTITION\"")
    error_message = "Graph server 1's user data must set PARTITION=1 and run the graph-server command."
  }

  assert {
    condition     = strcontains(module.compute.user_data["param_server-0"], "\nSHARD=0\n") && strcontains(module.compute.user_data["param_server-0"], "exec dorylus param-server")
    error_message = "The parameter server's user data must set SHARD=0 and run the param-server command."
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-0"], "DORYLUS_STALENESS=0") && strcontains(module.compute.user_data["graph_server-0"], "DORYLUS_DATASET_URI=s3://")
    error_message = "The servers' environment must carry the staleness and the dataset location."
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-0"], "\nDORYLUS_RUN_ID=dorylus\n") && strcontains(module.compute.user_data["param_server-0"], "\nNUM_PARTITIONS=2\n")
    error_message = "The servers' environment must carry the run id and the partition count the command lines expand."
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-1"], "exec dorylus tensor-worker --worker-id \"$PARTITION\"") && strcontains(module.compute.user_data["graph_server-1"], "systemctl enable --now dorylus-sidecar@tensor-worker.service")
    error_message = "Every graph server must run a tensor worker beside it, in its own unit."
  }

  assert {
    condition     = strcontains(module.compute.user_data["param_server-0"], "exec dorylus train --config /etc/dorylus/config.toml --transport kafka") && strcontains(module.compute.user_data["param_server-0"], "systemctl enable --now dorylus-sidecar@driver.service") && !strcontains(module.compute.user_data["param_server-0"], "sidecar@tensor-worker")
    error_message = "The parameter server must run the driver beside it (and no tensor worker)."
  }

  assert {
    condition     = can(regex("aws s3 sync --region us-east-1 --only-show-errors s3://[^ /]+/datasets/reddit/ /var/lib/dorylus/datasets/", module.compute.user_data["graph_server-0"]))
    error_message = "A graph server must fetch the dataset before it starts."
  }
}

run "no_sidecars" {
  command = apply

  variables {
    tensor_worker_command = ""
    driver_command        = ""
  }

  assert {
    condition     = !strcontains(module.compute.user_data["graph_server-0"], "systemctl enable --now dorylus-sidecar@") && !strcontains(module.compute.user_data["param_server-0"], "systemctl enable --now dorylus-sidecar@")
    error_message = "Empty side-process commands must start no side process."
  }
}

run "one_param_server" {
  command = plan

  variables {
    param_server_count = 2
  }

  expect_failures = [var.param_server_count]
}

run "rendered_command" {
  command = apply

  variables {
    graph_server_command = "dorylus graph-server --partition \"$PARTITION\" --bootstrap \"$DORYLUS_BOOTSTRAP\" --config /etc/dorylus/config.toml --staleness 0 --lambdas 80"
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-0"], "--staleness 0 --lambdas 80")
    error_message = "The user data must run the command line it is given."
  }
}

run "existing_kafka" {
  command = apply

  variables {
    create_msk                 = false
    existing_kafka_bootstrap   = "kafka-1.internal:9096,kafka-2.internal:9096"
    existing_kafka_cidr_blocks = ["10.50.0.0/24"]
    kafka_auth                 = "scram"
    msk_scram_secret_arns      = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:kafka-creds-AbCdEf"]
  }

  assert {
    condition     = output.kafka_bootstrap_brokers == "kafka-1.internal:9096,kafka-2.internal:9096" && output.kafka_cluster_arn == ""
    error_message = "With an existing cluster the bootstrap output must be the given string."
  }

  assert {
    condition     = strcontains(module.compute.user_data["graph_server-0"], "DORYLUS_KAFKA_SECRET_ARN=arn:aws:secretsmanager:us-east-1:123456789012:secret:kafka-creds-AbCdEf")
    error_message = "With SCRAM auth the servers must be told where their credentials are."
  }
}

run "too_little_concurrency" {
  command = plan

  variables {
    lambda_reserved_concurrency = 100
  }

  expect_failures = [var.lambda_reserved_concurrency]
}

run "existing_kafka_needs_bootstrap" {
  command = plan

  variables {
    create_msk = false
  }

  expect_failures = [var.existing_kafka_bootstrap]
}
