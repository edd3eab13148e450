"""`tinker://` paths of saved weights: `tinker://<training client>/<weights|sampler_weights>/<name>`. `weights`
are a state (adapter and optimizer, for load_weights), `sampler_weights` an adapter to sample under. The one place
that writes and reads them, for the door, the service and the worker."""

from __future__ import annotations

from typing import NamedTuple

SCHEME = "tinker://"
# Path segment -> the stored kind of the weights.
KINDS = {"weights": "state", "sampler_weights": "sampler"}
SEGMENTS = {kind: segment for segment, kind in KINDS.items()}


class WeightsAddress(NamedTuple):
    training_client_id: str
    kind: str  # "state" | "sampler"
    name: str


def weights_path(training_client_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{training_client_id}/{SEGMENTS[kind]}/{name}"


def parse_weights_path(path: str) -> WeightsAddress | None:
    """The parts of a well-formed path; None for anything else."""
    if not path.startswith(SCHEME):
        return None
    parts = path.removeprefix(SCHEME).split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        return None
    return WeightsAddress(parts[0], KINDS[parts[1]], parts[2])
