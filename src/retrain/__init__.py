"""retrain: a workflow-orchestrated MLOps pipeline that keeps an object detector current."""

__version__ = "0.1.0"
