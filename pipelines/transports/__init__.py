"""Transports: the channel interface the engine talks through, in memory (default) and over Kafka topics. They
carry `schemas.tasks.Message` records and import nothing of the engine."""
