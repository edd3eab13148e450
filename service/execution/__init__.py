"""The execution port: everything a worker may ask of the service, and the only part of it the worker imports
(an import-linter contract in pyproject.toml says so).

- `lease`: the fair claim, the lease heartbeat and attempt fencing;
- `reporting`: fenced progress reports of an attempt (steps, samples, events, checkpoints, final state);
- `inputs`: what an attempt reads once after its claim (spec, datasets, reward endpoints, checkpoints);
- `reaper`: recovery of lapsed leases and lost messages, and the idempotency-key sweep;
- `repository`: the SQL behind them, on the jobs table.
"""
