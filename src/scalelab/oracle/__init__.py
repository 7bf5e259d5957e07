"""The float64 NumPy oracle: layer primitives written from their definitions, and the check."""
