"""Plan room: a discrete-event simulator of the engine's schedule, calibrated from measured runs, that predicts
epoch time, cost and value of candidate deployments (`dorylus plan`)."""
