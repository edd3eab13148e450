"""The GRPO engine: a pure library (no database, Celery or HTTP-server imports).

Importing this package must stay cheap and torch-free so that the service can share
`contract.config` and `contract.spec` without pulling in torch. Import the
submodules (`worker.grpo.trainer`, ...) directly.
"""
