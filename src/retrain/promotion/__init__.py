"""The promote stage: the gate (pure) and the promotion it records in the model registry."""
