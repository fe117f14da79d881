"""The MLflow side: tracking URI, the registry's champion (the only code that talks to the registry)."""
