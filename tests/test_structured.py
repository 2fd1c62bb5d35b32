"""Structured outputs (issue 47): replies held to a JSON schema by llguidance's token mask in
our sampler, on the default model at temperature 1 (where it would stray most): in a batch
beside unconstrained requests (each row its own matcher), with speculative decoding on (its drafts
verified against masked rows), with a warm prefix cache, through the CLI and in the
bench; a bad schema refused before it queues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import main
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.core.structured import Constraint
from engine.errors import InvalidRequestError
from engine.loader.load import load_model
from engine.speculative.config import parse_speculative

pytestmark = pytest.mark.real_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    try:
        got = json.loads(text)
    except ValueError:
        return False
    return (
        set(got) == {"city", "population", "coastal"}
        and isinstance(got["city"], str) and len(got["city"]) <= 24
        and isinstance(got["population"], int) and got["population"] >= 0
        and isinstance(got["coastal"], bool)
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    return load_model(default_model, config=EngineConfig(num_blocks=512))


def run_batch(engine: LLMEngine, params: list[SamplingParams], prompt: list[int]) -> list[str]:
    """Every request added, then stepped together: one batch."""
    rids = [engine.add_request(prompt, p) for p in params]
    text = dict.fromkeys(rids, "")
    finish: dict[str, str] = {}
    while len(finish) < len(rids):
        for event in engine.step():
            text[event.request_id] += event.text
            if event.finish_reason is not None:
                finish[event.request_id] = event.finish_reason
    assert all(finish[r] == "stop" for r, p in zip(rids, params, strict=True) if p.constraint)
    return [text[r] for r in rids]


def test_a_batch_at_temperature_one_keeps_every_constrained_row_to_its_schema(engine):
    prompt = engine.chat_prompt_ids([{"role": "user", "content": "Describe a city as JSON."}])
    held = Constraint.json_schema(SCHEMA)
    params = [
        SamplingParams(
            max_new_tokens=80, temperature=1.0, seed=i, constraint=held if i % 4 else None
        )
        for i in range(8)
    ]
    texts = run_batch(engine, params, prompt)
    assert all(valid(t) for t, p in zip(texts, params, strict=True) if p.constraint), texts
    free = [t for t, p in zip(texts, params, strict=True) if p.constraint is None]
    assert not all(valid(t) for t in free)  # the mask, not the model, made them valid
    assert engine.grammars.mask_steps > 0 and engine.grammars.mask_s > 0


def test_speculation_and_a_warm_prefix_cache_keep_the_schema(engine):
    """Drafts verified against the masked rows: a draft the grammar refuses is rejected and
    its replacement is one the grammar allows. The prompt repeats the schema's words, so the
    lookup drafter proposes from it; some of its drafts are accepted, every reply is valid."""
    prompt = engine.chat_prompt_ids([{"role": "user", "content": (
        'Describe Lisbon as JSON like {"city": "Lisbon", "population": 545000, "coastal": '
        'true}.')}])  # fmt: skip
    held = Constraint.json_schema(SCHEMA)
    engine.set_speculation(parse_speculative("lookup", k=4, adaptive=False))
    try:
        for seed in range(3):  # the later ones find the prompt's blocks cached
            params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed, constraint=held)
            (text,) = run_batch(engine, [params], prompt)
            assert valid(text), text
        stats = engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    finally:
        engine.set_speculation(None)
    assert engine.metrics().prefix_cache_hit_tokens > 0


def test_a_bad_schema_is_refused_before_it_queues(engine):
    with pytest.raises(InvalidRequestError, match="the json_schema constraint is invalid"):
        engine.add_request([1, 2, 3], SamplingParams(constraint=Constraint.json_schema(
            {"type": "objectx"})))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="not JSON"):
        Constraint("json_schema", "{bad")
    assert not engine.has_work()


def test_the_cli_holds_generate_to_a_schema_file(tmp_path, capsys):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(SCHEMA))
    code = main(["generate", "--model", "default", "--chat", "A city as JSON", "--json-schema",
                 str(schema), "--temperature", "1", "--seed", "3", "--max-new-tokens", "80",
                 "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert valid(json.loads(out)["text"])
    assert "grammar mask:" in err and "ms/step" in err


def test_the_bench_measures_the_mask_per_step(default_model):
    from engine.bench.structured import format_structured_report, run_structured_bench

    report = run_structured_bench(default_model, batch=2, new_tokens=24, repeats=1,
                                  engine_config=EngineConfig(num_blocks=64))  # fmt: skip
    assert report["held"]["mask_ms_per_step"] > 0 and report["free"]["mask_ms_per_step"] == 0
    assert report["held"]["steps"] >= 1 and report["free"]["steps"] >= 1
    table = format_structured_report(report)
    assert "mask ms/step" in table and table.count("\n") == 3
