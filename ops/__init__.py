"""Pure JAX kernels and model definitions: GA/SC sparse kernels, AV/AE dense kernels, losses, stage lists; the
model's identity (`spec.ModelSpec`) and the ``stage/param`` parameter naming (`params`)."""
