"""The A/B lab with a server on one side (engine/evals/remote.py, app/endpoints/remote.py): a
local INT4 model against ``infersight serve`` at fp32 in a child process (tests/served.py),
every figure checked against the local-vs-local lab's on the same two precisions — equal where
the report calls it exact, the pooled KL recomputed from the two local tables on the support
the server returned and never above the full KL; then behind a proxy that refuses what
OpenAI's API refuses (token ids, ``echo``) and has no ``/tokenize``; then against a local model
of another tokenizer."""

from __future__ import annotations

import http.client
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import torch
import torch.nn.functional as F

from app.endpoints.client import Endpoint, with_model
from app.endpoints.remote import TOP_K, ServerSide
from engine.core.sampling import SamplingParams
from engine.evals.compare import compare_prompt
from engine.evals.remote import compare_with_remote, ids_by_text
from engine.evals.scoring import score
from engine.evals.sides import Side, prompt_ids_for
from engine.hardware.cpu_paths import cpu_paths
from engine.loader.load import load_model
from tests.served import KEY, request

PROMPT = "Name three colours."
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = SamplingParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def local(default_model):
    if not cpu_paths().int4_kernel.ok:
        pytest.skip(f"no INT4 kernel here: {cpu_paths().int4_kernel.why}")
    return load_model(default_model, precision="int4-g32"), load_model(default_model)


@pytest.fixture(scope="module")
def lab(local):
    """The local lab's report of INT4 (A) against fp32 (B): the figures to meet."""
    int4, fp32 = local
    return compare_prompt(int4, fp32, PROMPT, Side(GREEDY), Side(GREEDY), noise=False,
                          speculate=False)  # fmt: skip


def remote(base: str, tokenizer=None) -> ServerSide:
    side = ServerSide(with_model(Endpoint(base, api_key=KEY)))
    if tokenizer is not None:
        side.ids_of = ids_by_text(tokenizer)
    return side


def pooled(la: torch.Tensor, lb: torch.Tensor, support: set[int]) -> float:
    """KL(a‖b) over ``support``, the rest pooled: straight from the two full tables."""
    ids = torch.tensor(sorted(support))
    pa, pb = la[ids].exp(), lb[ids].exp()
    rest_a, rest_b = 1 - pa.sum(), 1 - pb.sum()
    return float((pa * (la[ids] - lb[ids])).sum() + rest_a * (rest_a.log() - rest_b.log()))


def test_local_int4_against_served_fp32_meets_the_local_labs_figures_within_the_top_k(
    server, local, lab
):
    int4, fp32 = local
    got = compare_with_remote({"a": int4, "b": remote(server)}, MESSAGES, PROMPT,
                              {"a": GREEDY, "b": GREEDY})  # fmt: skip
    for side in "ab":  # fp32 served and fp32 here: the same greedy answer
        assert got[side]["token_ids"] == lab[side]["token_ids"] and got[side]["token_ids"]
    assert got["divergence"] == lab["divergence"]
    assert got["b"]["remote"] and got["b"]["precision"] == "server"
    assert got["bounds"]["k"] == TOP_K and "as the local model does" in got["bounds"]["tokenizer"]
    prompt = prompt_ids_for(int4, MESSAGES)
    for column in "ab":
        ids = lab[column]["token_ids"]
        la = F.log_softmax(score(int4, prompt, ids).double(), -1)
        lb = F.log_softmax(score(fp32, prompt, ids).double(), -1)
        figures, exact = got["columns"][column], lab["columns"][column]
        assert len(figures["kl"]) == len(ids)
        assert figures["p_a"] == pytest.approx(exact["p_a"], abs=1e-4)  # local INT4 both times
        assert figures["p_b"] == pytest.approx(exact["p_b"], abs=1e-4)  # served and local fp32
        for i, token in enumerate(ids):
            support = set(lb[i].topk(TOP_K).indices.tolist()) | {token}
            assert figures["kl"][i] == pytest.approx(pooled(la[i], lb[i], support), abs=2e-5)
            assert figures["kl"][i] <= exact["kl"][i] + 1e-6  # a lower bound of the full KL
            outside = 1 - float(la[i][sorted(support)].exp().sum())
            assert figures["outside_a"][i] == pytest.approx(outside, abs=1e-5)
            rank = int((lb[i] > lb[i, token]).sum()) + 1
            assert figures["rank_b"][i] == (rank if rank <= TOP_K else None)
            assert figures["rank_a"][i] == int((la[i] > la[i, token]).sum()) + 1
    summary, full = got["summary"], lab["summary"]
    assert summary["top1_agreement"] == full["top1_agreement"]
    assert summary["rms_dp"] == pytest.approx(full["rms_dp"], abs=1e-4)
    assert summary["kl_mean"] <= full["kl_mean"] + 1e-6
    accepted = full["speculative"]["sampling_acceptance"]
    low, high = (summary["speculative"][k] for k in ("sampling_acceptance",
                                                     "sampling_acceptance_high"))  # fmt: skip
    assert low - 1e-4 <= accepted <= high + 1e-4


class Strict(BaseHTTPRequestHandler):
    """A proxy in front of the real server that refuses, as OpenAI's API does, the fields it
    does not know (vLLM's token ids) and ``echo`` on a chat model, and has no ``/tokenize``."""

    upstream = ""
    quiet = False  # drop unknown fields without a word (llama.cpp's server, most proxies)

    def log_message(self, *args: object) -> None:
        pass

    def _refuse(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._refuse(404, "Not Found")
        if "return_tokens_as_token_ids" in body and self.quiet:
            del body["return_tokens_as_token_ids"]
        if "return_tokens_as_token_ids" in body:
            return self._refuse(400, "Unrecognized request argument supplied: "
                                     "return_tokens_as_token_ids")  # fmt: skip
        if body.get("echo"):
            return self._refuse(400, "echo is not supported with this model")
        self._forward(json.dumps(body).encode())

    def _forward(self, data: bytes | None) -> None:
        where = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        headers = {"Authorization": self.headers.get("Authorization", "")}
        if data is not None:
            headers["Content-Type"] = "application/json"
        conn.request("POST" if data is not None else "GET", self.path, data, headers)
        answer = conn.getresponse()
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.getheader("Content-Type", "application/json"))
        self.send_header("Connection", "close")
        self.end_headers()
        while chunk := answer.read1(65536):
            self.wfile.write(chunk)
            self.wfile.flush()
        conn.close()


@pytest.fixture(params=[False, True], ids=["refuses", "drops"])
def strict(server, request) -> Iterator[str]:
    handler = type("StrictTo", (Strict,), {"upstream": server, "quiet": request.param})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()
    proxy.server_close()


def test_a_server_without_token_ids_echo_or_tokenize_is_compared_up_to_the_divergence(
    strict, local, lab
):
    int4, _ = local
    got = compare_with_remote({"a": int4, "b": remote(strict, int4.tokenizer)}, MESSAGES,
                              PROMPT, {"a": GREEDY, "b": GREEDY})  # fmt: skip
    for side in "ab":  # token texts read back to the same ids
        assert got[side]["token_ids"] == lab[side]["token_ids"]
    bounds = got["bounds"]
    assert "no /tokenize" in bounds["tokenizer"]
    assert any("by text only" in n for n in bounds["notes"])
    index = lab["divergence"]["index"]
    assert index is not None, "the two precisions part within 16 tokens on this prompt"
    assert f"stop at the first divergence (token {index})" in bounds["text"]
    a_column, b_column = got["columns"]["a"], got["columns"]["b"]
    assert len(a_column["kl"]) == index  # B read A's answer only where they agree
    assert len(b_column["kl"]) == len(lab["b"]["token_ids"])  # A (local) read all of B's
    exact = lab["columns"]["a"]
    assert a_column["p_b"] == pytest.approx(exact["p_b"][:index], abs=1e-4)
    assert all(kl <= full + 1e-6 for kl, full in zip(a_column["kl"], exact["kl"], strict=False))


def test_a_local_model_of_another_tokenizer_is_compared_as_text_and_says_so(server, tiny_model_dir):
    folder, _ = tiny_model_dir("llama", False)
    other = load_model(folder)
    got = compare_with_remote({"a": other, "b": remote(server)}, MESSAGES, PROMPT,
                              {"a": GREEDY, "b": GREEDY})  # fmt: skip
    assert got["columns"] == {} and got["summary"]["text_only"]
    assert "tokenizes the prompt otherwise" in got["bounds"]["tokenizer"]
    assert "compared as text only" in got["bounds"]["text"]
    a, b = got["a"]["text"], got["b"]["text"]
    assert b and got["summary"]["flips"] == (a != b)
    at = got["divergence"]["char_index"]
    assert a[:at] == b[:at] and (at == min(len(a), len(b)) or a[at] != b[at])
    assert not math.isnan(got["b"]["ttft_s"])


def test_serve_names_tokens_by_id_where_asked_as_vllm_does(server, client):
    """vLLM's ``return_tokens_as_token_ids``, through the openai SDK: the same tokens, each
    named ``token_id:<id>``, the text and its offsets unchanged."""
    model = client.models.list().data[0].id
    asked = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
             "logprobs": 3}  # fmt: skip
    plain = client.completions.create(**asked).choices[0]
    by_id = client.completions.create(
        **asked, extra_body={"return_tokens_as_token_ids": True}
    ).choices[0]
    assert by_id.text == plain.text
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    status, _, body = request(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200
    assert "".join(plain.logprobs.tokens) == json.loads(body)["prompt"] == plain.text
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset
    assert by_id.logprobs.token_logprobs == plain.logprobs.token_logprobs
    for top in by_id.logprobs.top_logprobs:
        assert len(top) == 3 and all(t.startswith("token_id:") for t in top)
