"""The engine: partitions, graph servers, tensor workers, the parameter server, watermarks and the scheduler;
`driver` is the epoch driver the in-process runner (`runner`) and the Kafka driver (`pipelines.launch`) share."""
