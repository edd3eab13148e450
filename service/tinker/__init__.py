"""The Tinker-compatible door under /tinker/api/v1 (docs/tinker.md): the official `tinker` SDK's routes over the
primitive training API (service.primitives)."""
