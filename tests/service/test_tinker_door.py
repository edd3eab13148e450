"""The Tinker door's refusals of a forward_backward body, in the SDK's error shape and naming the field: what the
SDK itself would not send (an unknown loss, a body that is not the message, an image chunk, NaN values)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from contract.gen.tinker_public import tinker_public_pb2 as pb
from tests.service.factories import TenantHeaders

URL = "/tinker/api/v1/forward_backward"


def _request(loss_fn: str = "importance_sampling", *, advantages: float = 1.0, image: bool = False) -> bytes:
    tokens = np.arange(1, 6, dtype="<i4")
    chunk = (pb.Chunk(image=pb.ImageChunk(data=b"\x89PNG", format="png")) if image
             else pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens.tobytes())))
    datum = pb.Datum(model_input=[chunk])
    inputs = {"target_tokens": (np.arange(2, 7, dtype="<i8"), pb.DTYPE_INT64),
              "logprobs": (np.zeros(5, "<f4"), pb.DTYPE_FLOAT32),
              "advantages": (np.full(5, advantages, "<f4"), pb.DTYPE_FLOAT32)}
    for name, (values, dtype) in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=values.tobytes(), dtype=dtype, shape=[5]))
    return pb.ForwardBackwardRequest(model_id="ses_x:train:0", seq_id=1, data=[datum],
                                     loss_fn=loss_fn).SerializeToString()


@pytest.mark.parametrize(("body", "field", "words"), [
    (_request("nope"), "loss_fn", "unknown loss function 'nope'"),
    (b"\xff\xff\xff not protobuf", "body", "not a tinker_public.ForwardBackwardRequest"),
    (_request(image=True), "data[0].model_input.chunks[0]", "image chunks are not supported"),
    (_request(advantages=float("nan")), "data[0].loss_fn_inputs.advantages", "NaN or infinity"),
])
def test_a_refused_body_names_its_field(client: TestClient, tenant_a: TenantHeaders, body: bytes, field: str,
                                        words: str) -> None:
    key = {"X-API-Key": "tml-" + tenant_a["Authorization"].removeprefix("Bearer "),
           "Content-Type": "application/x-protobuf"}
    response = client.post(URL, content=body, headers=key)
    assert response.status_code == 422, response.text
    refused = response.json()
    assert refused["category"] == "user" and refused["code"] == "validation_error"
    assert refused["error"].startswith(f"{field}: ") and words in refused["error"]
    assert refused["details"][0]["field"] == field
