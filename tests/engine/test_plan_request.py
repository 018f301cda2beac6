"""The plan request crosses to the engine child whole, as JSON (serve --plan-request), and comes back equal."""

import pytest

from stowage.engine.errors import InvalidArgumentError
from stowage.engine.planning.plan import PlanRequest


def test_a_request_round_trips_through_json():
    request = PlanRequest(8192, kv_dtype="float16", dtype="bfloat16", gpu_layers=3, block_size=32, prefill_chunk=256,
                          num_seqs=4, kv_disk_budget=0)
    assert PlanRequest.from_json(request.to_json()) == request
    assert PlanRequest.from_json(PlanRequest(64).to_json()) == PlanRequest(64)


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[64]", "must be an object"),
    ('{"num_seqs": 2}', "must be an object with context_tokens"),
    ('{"context_tokens": 64, "tokens": 3}', "must be an object"),
    ('{"context_tokens": 0}', "context_tokens must be at least 1"),
    ('{"context_tokens": 64, "kv_dtype": "int3"}', "int3"),
    ('{"context_tokens": true}', "integers, names or null"),
    ('{"context_tokens": 64, "num_seqs": [1]}', "integers, names or null"),
])
def test_anything_else_is_a_typed_error_naming_the_problem(text, says):
    with pytest.raises(InvalidArgumentError, match=says):
        PlanRequest.from_json(text)
