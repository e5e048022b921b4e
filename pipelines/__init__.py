"""Everything that moves data and time: graph data, the engine, transports, Beam pipelines, the CLI."""
