"""The GRPO service: REST + gRPC API, domain logic, database models and storage. Never imports torch."""
