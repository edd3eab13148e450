"""Errors of the primitive training API's engine (worker.grpo.primitive_losses, worker.grpo.resident).

Each names what the caller got wrong, so a service can answer 4xx with the field or id in its details.
"""

from __future__ import annotations


class PrimitiveInputError(ValueError):
    """A request's input is unusable: `field` names it as the caller wrote it, e.g.
    `data[2].loss_fn_inputs.advantages` or `loss_fn_config.beta`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PrimitiveNotFound(LookupError):
    """No client (training adapter) or sampler of that id is loaded."""

    def __init__(self, kind: str, identifier: str) -> None:
        super().__init__(f"no {kind} {identifier!r} is loaded")
        self.kind = kind
        self.identifier = identifier


class PrimitiveConflict(ValueError):
    """The id is taken already (client and sampler ids share one namespace: `sample` takes either)."""

    def __init__(self, identifier: str) -> None:
        super().__init__(f"an adapter {identifier!r} is loaded already")
        self.identifier = identifier
