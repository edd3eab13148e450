"""Worker side of the GRPO service: Celery app, job execution, reward clients and the engine."""
