"""What the server stores on disk: the model registry, results and inputs (R1, R2)."""
