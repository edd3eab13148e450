"""The `fused` backend: the CPU fast path, for the Llama family on a small CPU.

Why it exists: on a CPU with few cores a small model's GEMMs scale poorly and every op pays a thread wake-up,
so the engine computes the same values with far fewer ops and keeps both cores busy (bench/README.md has the
figures against TRL):

- log-probs through `fast_decoder` (one fused full-sequence forward, the LM head chunked) and sampling through
  `static_decoder` (a preallocated cache, a `decode_step` compiled by TorchScript, two decode lanes measured
  against one): `path.FusedPath`, the `ModelBundle.fast` the generic paths take;
- a second CPU lane (`worker.grpo.concurrency`): the reference forward runs beside the policy's, and the first
  pass's forward and backward run as two halves side by side, each on one core (`backend.FusedBackend`).

Everything it computes equals the module path's up to float rounding; the parity tests hold it to transformers
and peft (tests/engine/test_fast_decoder*.py). Where the fast path does not cover a sequence (a sliding window
shorter than it, dropout in training), the same calls fall back to the module forward.
"""

from worker.grpo.backends.fused.backend import FusedBackend
from worker.grpo.backends.fused.path import FusedPath

__all__ = ["FusedBackend", "FusedPath"]
