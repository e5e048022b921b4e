"""Transports: the channel interface the engine talks through, in memory (default) and over Kafka topics."""
