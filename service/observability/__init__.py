"""Operations signals: Prometheus metrics for the API, structured (JSON) logs with job context."""
