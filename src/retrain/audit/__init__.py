"""The ``audit`` stage: the champion looks for label errors in the batches it has not trained on (cleanlab)."""
