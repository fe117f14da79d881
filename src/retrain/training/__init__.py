"""Training: a Lightning module around ultralytics' DetectionModel, its datamodule, callbacks and train()."""
