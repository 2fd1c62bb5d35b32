"""``infersight serve`` against what the ecosystem sends (issue 47): every field of the openai
SDK's completions and chat parameters implemented or refused by name, vLLM's sampling extras
(``ignore_eos``, ``min_tokens``, ``stop_token_ids``, …), ``echo`` with the prompt's
log-probabilities, several prompts in one request, vLLM's tokenizer routes, and
lm-evaluation-harness's ``local-completions`` scoring a task of our own through the server as
transformers scores it in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams

from app.server.fields import LABELS
from app.server.schema import ChatBody, CompletionBody
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model
from tests.served import KEY, request, wait_idle

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    """The served model in this process: the oracle the server's answers are compared with."""
    return load_model(default_model)


ROUTES = [
    ("/v1/completions", CompletionParams, CompletionBody, {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/chat/completions", ChatParams, ChatBody,
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "sdk", "ours", "base"), ROUTES)
def test_every_sdk_parameter_is_implemented_or_refused_by_name(server, path, sdk, ours, base):
    """Each field the openai SDK can send: ours acts on it, it only labels the request, or a
    value that would change the answer is refused with a 400 naming it (never dropped)."""
    unhandled = []
    for name in sorted(sdk.__annotations__):
        if name in ours.model_fields:
            continue
        status, _, body = request(server, "POST", path, {**base, name: "a value we lack"})
        if name in LABELS:
            if status != 200:
                unhandled.append(f"{name}: a label answered {status}")
            continue
        error = json.loads(body).get("error", {})
        if status != 400 or f"'{name}'" not in error.get("message", "") or error["param"] != name:
            unhandled.append(f"{name}: {status} {body[:200]!r}")
    assert not unhandled, "\n".join(unhandled)


def test_a_misspelled_field_is_refused_with_the_name_meant(server):
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "Hi", "max_token": 5})  # fmt: skip
    assert status == 400
    assert (
        json.loads(body)["error"]["message"]
        == "unknown field 'max_token'; did you mean 'max_tokens'?"
    )


def test_the_values_that_do_nothing_are_accepted(server):
    """Clients send their defaults: ``frequency_penalty: 0``, ``logit_bias: {}``, ``tools: []``
    and nulls change nothing, so they pass."""
    noops = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [],
             "tool_choice": "none", "response_format": {"type": "text"}, "audio": None,
             "user": "me", "metadata": {"run": "1"}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **noops}
    assert request(server, "POST", "/v1/chat/completions", body)[0] == 200
    refused = request(server, "POST", "/v1/chat/completions", {**body, "frequency_penalty": 0.5})
    assert refused[0] == 400 and b"'frequency_penalty' is not supported" in refused[2]


def test_ignore_eos_and_min_tokens_give_the_tokens_asked_for(client):
    """A load generator asks for exactly N tokens: without ``ignore_eos`` the model stops
    early here, with it every request gives N."""
    messages = [{"role": "user", "content": "Say hi."}]
    free = client.chat.completions.create(
        model=None, messages=messages, max_tokens=48, temperature=0
    )  # type: ignore[arg-type]
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 48
    early = free.usage.completion_tokens
    forced = client.chat.completions.create(
        model=None, messages=messages, max_tokens=48, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )  # type: ignore[arg-type]  # fmt: skip
    assert forced.usage.completion_tokens == 2 * 48
    assert {c.finish_reason for c in forced.choices} == {"length"}
    held = client.chat.completions.create(
        model=None, messages=messages, max_tokens=48, temperature=0,
        extra_body={"min_tokens": early + 5},
    )  # type: ignore[arg-type]  # fmt: skip
    assert held.usage.completion_tokens >= early + 5


def test_echo_scores_each_prompt_as_the_engine_does(client, engine):
    """Harnesses' loglikelihood request: several token prompts, ``echo``, ``max_tokens: 0``
    and ``logprobs``: each choice is its prompt, with each token's log-probability (the
    first's null) as the engine computes them in its prefill."""
    tok = engine.tokenizer
    prompts = [tok.encode("The capital of France is Paris"), tok.encode("Bees make honey")]
    out = client.completions.create(
        model=None, prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0
    )  # type: ignore[arg-type]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 0
    for choice, ids in zip(out.choices, prompts, strict=True):
        assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
        lps = choice.logprobs
        assert lps.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        (want,) = _prompt_logprobs(engine, ids)
        assert lps.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert all(len(top) == 2 for top in lps.top_logprobs[1:])


def _prompt_logprobs(engine: LLMEngine, *prompts: list[int]) -> list[list[float]]:
    """Each prompt's tokens' log-probabilities from the engine's prefill, in one batch."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    rids = [engine.add_request(ids, params) for ids in prompts]
    got: dict[str, list[float]] = {}
    while engine.has_work():
        for event in engine.step():
            if event.prompt_logprobs is not None:
                got[event.request_id] = [lp[0] for lp in event.prompt_logprobs[1:] if lp]
    return [got[r] for r in rids]


def test_the_tokenizer_routes_answer_as_vllm_does(server, engine):
    tok = engine.tokenizer
    status, _, body = request(server, "POST", "/tokenize",
                              {"prompt": "Hello there", "add_special_tokens": False})  # fmt: skip
    got = json.loads(body)
    assert status == 200 and got["tokens"] == tok.encode("Hello there")
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == engine.context_length
    status, _, body = request(server, "POST", "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": "Hello there"}
    status, _, body = request(server, "GET", "/tokenizer_info")
    info = json.loads(body)
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    chat = request(server, "POST", "/tokenize",
                   {"messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert json.loads(chat[2])["tokens"] == engine.chat_prompt_ids(
        [{"role": "user", "content": "Hi"}]
    )
    assert request(server, "POST", "/detokenize", {"tokens": [10**9]})[0] == 400
    assert request(server, "GET", "/tokenizer_info", key=None)[0] == 401


def test_lm_eval_scores_through_the_server_as_transformers_does(
    server, engine, default_model, tmp_path, monkeypatch,
):  # fmt: skip
    """lm-evaluation-harness's ``local-completions`` (its remote tokenizer, batches of 4
    prompts) against ``serve``: each choice's loglikelihood equals the engine's own within
    1e-4, and the accuracy equals lm-eval's ``hf`` model (transformers) on the same folder."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = Path(__file__).parent / "data" / "lm_eval"
    task = (data / "infersight_mc.yaml").read_text().replace("DATA_FILE", str(data / "mc.jsonl"))
    (tmp_path / "infersight_mc.yaml").write_text(task)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    name = json.loads(request(server, "GET", "/v1/models")[2])["data"][0]["id"]
    args = (f"base_url={server}/v1/completions,model={name},auth_token={KEY},batch_size=4,"
            "num_concurrent=1,max_retries=1,tokenized_requests=True")  # fmt: skip

    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)

    def run(model: str, model_args: str) -> tuple[float, list[list[float]]]:
        out = simple_evaluate(
            model=model, model_args=model_args, tasks=["infersight_mc"], log_samples=True,
            task_manager=tasks,
        )  # fmt: skip
        samples = sorted(out["samples"]["infersight_mc"], key=lambda s: s["doc_id"])
        lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
        return out["results"]["infersight_mc"]["acc,none"], lls

    served_acc, served = run("local-completions", args)
    hf_acc, hf = run("hf", f"pretrained={default_model},dtype=float32,device=cpu")
    tok = engine.tokenizer
    docs = [json.loads(line) for line in (data / "mc.jsonl").read_text().splitlines()]
    pairs = [(len(tok.encode(d["question"])), tok.encode(f"{d['question']} {c}"))
             for d in docs for c in d["choices"]]  # lm-eval's: the pair encoded whole  # fmt: skip
    scored = _prompt_logprobs(engine, *(whole for _, whole in pairs))
    ours = [sum(lps[ctx - 1 :]) for (ctx, _), lps in zip(pairs, scored, strict=True)]
    assert [ll for lls in served for ll in lls] == pytest.approx(ours, abs=1e-4)
    assert served_acc == hf_acc
    assert (
        max(abs(a - b) for x, y in zip(served, hf, strict=True) for a, b in zip(x, y, strict=True))
        < 1e-3
    )


def test_metrics_equal_the_per_request_sums_after_a_mixed_run(server, client, engine):
    """vLLM's meanings: ``prompt_tokens`` counts each served request's whole prompt (a cached
    prefix too, also counted on its own), ``generation_tokens`` each token made, a cancel is
    ``abort``; the self-test counts nowhere. Whole and streamed replies, a stop string, ``n``,
    a repeated prompt (cached) and a stream its client leaves after four chunks."""
    before = wait_idle(server)
    tok = engine.tokenizer
    prompt_sum = completion_sum = 0
    repeated = "Tell me about the ocean and its tides. " * 4
    for text, extra in [
        (repeated, {"max_tokens": 6}),
        (repeated, {"max_tokens": 6}),  # the prefix cache holds its blocks now
        ("Count to ten: 1, 2, 3,", {"max_tokens": 12, "stop": [" 6"]}),
        ("Hello", {"max_tokens": 5, "n": 2}),
    ]:
        done = client.completions.create(model=None, prompt=text, temperature=0, **extra)  # type: ignore[arg-type]
        prompt_sum += len(tok.encode_prompt(text)) * extra.get("n", 1)
        completion_sum += done.usage.completion_tokens
    for chunk in client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Hi there"}], max_tokens=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):  # type: ignore[arg-type]  # fmt: skip
        if chunk.usage is not None:
            prompt_sum += chunk.usage.prompt_tokens
            completion_sum += chunk.usage.completion_tokens
    leaving = "Write a very long story about a lighthouse."
    stream = client.completions.create(model=None, prompt=leaving, max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True})  # type: ignore[arg-type]  # fmt: skip
    for _, _ in zip(range(4), stream, strict=False):
        pass
    stream.close()
    prompt_sum += len(tok.encode_prompt(leaving))
    after = wait_idle(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    made = grew("vllm:request_generation_tokens_sum")  # every request's, the left one's too
    # the client that left read 4 tokens; the engine may have made more before the cancel
    assert grew("vllm:generation_tokens_total") == made and made >= completion_sum + 4
    assert grew("vllm:prompt_tokens_total") == prompt_sum == grew("vllm:request_prompt_tokens_sum")
    assert grew("infersight:prompt_tokens_cached_total") >= 16  # the repeat's blocks
    assert grew("vllm:request_success_total{finished_reason=abort}") == 1
    ended = sum(
        grew(f"vllm:request_success_total{{finished_reason={r}}}") for r in ("stop", "length")
    )
    assert ended == 6


def test_parse_gives_schema_valid_objects_at_temperature_one_in_a_batch_of_eight(server, client):
    """The openai SDK's ``chat.completions.parse(response_format=<pydantic model>)``: it sends
    the model's JSON schema (strict) and parses the reply; twenty requests, eight at a time,
    at temperature 1, every one valid."""
    from concurrent.futures import ThreadPoolExecutor

    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=24)
        population: int = Field(ge=0)
        coastal: bool

    def ask(seed: int) -> City | None:
        done = client.chat.completions.parse(
            model=None, messages=[{"role": "user", "content": "Describe a city."}],  # type: ignore[arg-type]
            response_format=City, temperature=1.0, seed=seed, max_tokens=80,
        )  # fmt: skip
        return done.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(ask, range(20)))
    assert all(isinstance(p, City) for p in parsed), parsed
    wrong = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": wrong}
    bad = request(server, "POST", "/v1/chat/completions", body)
    assert bad[0] == 400 and json.loads(bad[2])["error"]["param"] == "response_format"
