"""Pure JAX kernels and model definitions: GA/SC sparse kernels, AV/AE dense kernels, losses, stage lists."""
