"""Property-based requests from the server's own /openapi.json (schemathesis), against a live `deltaserve serve`.

Every documented operation gets a small budget of schema-valid (positive) and schema-violating (negative) requests,
and every response is checked by every schemathesis check: no 5xx, status codes, content types, headers and bodies
as documented, invalid data rejected, authentication enforced, unsupported methods answered with 405 + Allow.

One check is left out, `positive_data_acceptance` (schema-valid requests must get a 2xx): the server rightly refuses
some schema-valid requests for reasons JSON schema cannot state — a prompt that tokenises to nothing or does not fit
the context, token ids outside this model's vocabulary, a tool message whose tool name cannot be resolved, a tokenize
request with neither prompt nor messages, integral floats such as 5.0 where the API takes only ints (JSON schema
counts them as integers). Those refusals are 400s with the OpenAI error body, which the other checks verify.
"""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.core.failures import FailureGroup

from server_utils import run_server

KEY = "sk-schemathesis"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Small limits bound each generated request's work: short contexts, few samples, few prompts.
SERVER_ARGS = ("--served-model-name", "tiny-st", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "5",
               "--max-model-len", "224", "--max-n", "2", "--max-prompts-per-request", "2",
               "--max-tokens-per-request", "512")
EXAMPLES = 8  # per operation and generation mode
EXCLUDED_CHECKS = {"positive_data_acceptance"}  # see the module docstring


@pytest.fixture(scope="module")
def server(make_checkpoint):
    with run_server(make_checkpoint("k31-tiny"), *SERVER_ARGS, api_key=KEY) as srv:
        yield srv


def _checks() -> list:
    load_all_checks()
    return [c for c in CHECKS.get_all() if c.__name__ not in EXCLUDED_CHECKS]


def test_openapi_document_holds_under_generated_requests(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    checks = _checks()
    assert {"not_a_server_error", "negative_data_rejection", "ignored_auth", "unsupported_method"} \
        <= {c.__name__ for c in checks}
    failures: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    statuses: collections.Counter = collections.Counter()
    operations = []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def exercise(case):
                response = case.call(base_url=server.url, headers=AUTH, timeout=30)
                statuses[(operation.label, response.status_code // 100)] += 1
                for check in checks:
                    try:
                        case.validate_response(response, checks=[check], headers=AUTH)
                    except FailureGroup as group:
                        failures[(operation.label, check.__name__)].append(
                            f"{response.status_code} {group.exceptions[0].title}: {response.text[:200]}")

            try:
                exercise()
            except Unsatisfiable:
                # An operation without parameters or body has no schema-violating request to generate.
                assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET", operation.label
    assert len(operations) >= 9, operations
    server_errors = {k: v for k, v in statuses.items() if k[1] == 5}
    assert not server_errors, server_errors
    assert not failures, "\n".join(f"{op} {check}: {len(msgs)}x, e.g. {msgs[0]}"
                                   for (op, check), msgs in failures.items())
    # The run reached the engine, not only the validators.
    assert statuses[("POST /v1/completions", 2)] > 0, statuses
