"""The engine: partitions, graph servers, tensor workers, the parameter server, watermarks and the scheduler."""
