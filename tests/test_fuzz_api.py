"""serve's OpenAPI document fuzzed by schemathesis (every operation; stateful testing does
not apply: no route answers with what another takes): no 5xx, no hang (30 s a request), and
every 4xx in OpenAI's error shape. A dedicated server with small limits (``max_tokens`` 8,
``n`` 2, 64 KiB bodies) keeps each generated request short; ``make fuzz-api`` runs the same at
length with schemathesis's own command line and report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checks.fuzz_api import KEY, st_env, st_run
from tests.served import request

pytest.importorskip("schemathesis")  # dev extras

EXAMPLES = int(os.environ.get("INFERSIGHT_FUZZ_EXAMPLES", "12"))
#: serve's limits for the fuzzing: what it must refuse past them, at once
LIMITS = ("--max-tokens", "8", "--max-n", "2", "--max-body-bytes", "65536",
          "--max-waiting", "16", "--self-test-interval", "0")  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fuzzed_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", "default", "--port", "0",
             "--api-key", KEY, *LIMITS], stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            base = ""
            while True:
                named = re.search(r" on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
                base = named.group(1) if named else ""
                try:
                    if base and request(base, "GET", "/health", key=None)[0] == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the server did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            proc.wait(30)


def fuzz(base: str, report: Path, examples: int) -> dict[str, Any]:
    """schemathesis's command line on ``base``'s OpenAPI document: its JSON report."""
    done = subprocess.run(st_run(base, examples, report), capture_output=True, text=True,
                          env=st_env(), timeout=600)  # fmt: skip
    (found,) = report.glob("*.json")
    result: dict[str, Any] = json.loads(found.read_text())
    result["output"] = done.stdout[-3000:]
    return result


def test_every_operation_answers_without_5xx_and_refuses_in_openais_shape(fuzzed_server, tmp_path):
    result = fuzz(fuzzed_server, tmp_path / "report", EXAMPLES)
    assert result["operations"]["tested"] == result["operations"]["total"] == 8, result["output"]
    cases = result["test_cases"]
    assert cases["generated"] > 8 * EXAMPLES // 2, result["output"]
    assert (cases["with_failures"], cases["errored"]) == (0, 0), result["output"]
    assert result["exit_code"] == 0, result["output"]


# -- what the fuzzing found, kept --------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "status"), [
    ("TRACE", "/v1/models", 405), ("DELETE", "/v1/chat/completions", 405),
    ("GET", "/v1/nothing-here", 404), ("POST", "/v2/completions", 404),
])  # fmt: skip
def test_a_route_not_there_or_a_method_it_does_not_take_is_refused_in_openais_shape(
    fuzzed_server, method, path, status
):
    got, _, body = request(fuzzed_server, method, path, key=KEY)
    error = json.loads(body)["error"]
    assert got == status and error["type"] == "invalid_request_error"
    assert path in error["message"]


@pytest.mark.parametrize("prompt", [[1398361859461382144000, 5], [-19872, 5], [5, 49152]])
def test_prompt_token_ids_outside_the_vocabulary_are_400_not_500(fuzzed_server, prompt):
    got, _, body = request(fuzzed_server, "POST", "/v1/completions",
                           {"prompt": prompt, "max_tokens": 2}, key=KEY)  # fmt: skip
    error = json.loads(body)["error"]
    assert got == 400 and error["param"] == "prompt"
    assert error["message"].startswith("prompt token ids must be in [0, ")


def test_the_document_names_the_refusals_as_they_answer(fuzzed_server):
    status, _, body = request(fuzzed_server, "GET", "/openapi.json", key=KEY)
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            codes = set(op["responses"])
            assert "422" not in codes, (method, path)  # validation failures answer 400
            assert {"400", "401", "413", "503"} <= codes, (method, path)
            error = op["responses"]["400"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert request(fuzzed_server, "GET", "/openapi.json", key=None)[0] == 401  # behind the key
