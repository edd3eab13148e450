"""The OpenAI-compatible fine-tuning API under /openai/v1 (docs/openai.md)."""
