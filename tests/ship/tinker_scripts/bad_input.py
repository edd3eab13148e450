"""Bad calls through the official `tinker` SDK (run in .venv-tinker): each must fail with a clear error in the
SDK's own exception types, and the training client must keep working afterwards.

Environment: TINKER_BASE_URL, TINKER_API_KEY, BASE_MODEL, FOREIGN_PATH (another tenant's saved weights).
Prints one JSON object: for each case, the exception's type and message; then whether training still works.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import tinker
from tinker import types


def outcome(call: Callable[[], Any]) -> dict[str, str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001  # the point is to report whatever the SDK raised
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


def datum(tokens: list[int], targets: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})


def main() -> None:
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=os.environ["BASE_MODEL"], rank=4, seed=1).result()
    tokens = tc.get_tokenizer().encode("user: Repeat a 2 times.\nassistant: aa")
    good = datum(tokens[:-1], tokens[1:])
    cases = {
        "wrong_shape": lambda: tc.forward_backward([datum(tokens[:-1], tokens[1:-1])], "cross_entropy").result(),
        "outside_vocabulary": lambda: tc.forward_backward([datum([*tokens[:-2], 10**6], tokens[1:])],
                                                          "cross_entropy").result(),
        "unknown_path": lambda: tc.load_state("tinker://ses_nothing:train:0/weights/final").result(),
        "foreign_path": lambda: tc.load_state(os.environ["FOREIGN_PATH"]).result(),
        "foreign_sampler": lambda: service.create_sampling_client(model_path=os.environ["FOREIGN_PATH"]).result(),
        "unknown_base_model": lambda: service.create_lora_training_client(base_model="org/not-served", rank=4).result(),
    }
    report = {name: outcome(call) for name, call in cases.items()}
    fb = tc.forward_backward([good], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    report["still_trains"] = {"type": "none", "message": str(fb.metrics.get("loss:sum"))}
    service.close("success")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
