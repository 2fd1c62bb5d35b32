"""The A/B comparison (engine/evals/compare.py): per-token figures against a direct computation
from the two models' logits, the divergence rule, the summary, the file format and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from app.cli.main import main
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import CancelledError, InvalidRequestError
from engine.evals.acceptance import measure_speculation
from engine.evals.compare import compare_prompt
from engine.evals.compare_file import FORMAT, document, read_document
from engine.evals.scoring import score
from engine.evals.sides import Side, prompt_ids_for
from engine.hardware.cpu_paths import cpu_paths
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model

PROMPT = "t1 t7 t3 t9 t2"


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    if not cpu_paths().int4_kernel.ok:
        pytest.skip(f"no INT4 kernel here: {cpu_paths().int4_kernel.why}")
    folder, _ = tiny_model_dir("llama", False)
    return (
        folder,
        load_model(folder, precision="fp32"),
        load_model(folder, precision="int4-g32"),
    )


def direct_logprobs(engine: LLMEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probs of each output position from one plain forward over the whole sequence."""
    seq = prompt + output
    logits = engine.runner.forward_logits(seq, engine.runner.new_cache(len(seq)), 0)
    return F.log_softmax(logits[len(prompt) - 1 : len(seq) - 1].double(), dim=-1)


def test_per_token_kl_equals_a_direct_computation_from_both_models_logits(engines):
    _, a, b = engines
    greedy = Side(SamplingParams(max_new_tokens=12))
    report = compare_prompt(a, b, PROMPT, greedy, greedy)
    prompt = prompt_ids_for(a, [{"role": "user", "content": PROMPT}])
    assert report["prompt_tokens"] == len(prompt)
    for key in ("a", "b"):
        ids = report[key]["token_ids"]
        la, lb = direct_logprobs(a, prompt, ids), direct_logprobs(b, prompt, ids)
        kl = (la.exp() * (la - lb)).sum(-1)
        column = report["columns"][key]
        assert len(column["kl"]) == len(ids) == len(report[key]["pieces"])
        assert torch.allclose(torch.tensor(column["kl"], dtype=torch.float64), kl, atol=1e-5)
        target = torch.tensor(ids)[:, None]
        p_a = la.gather(1, target).exp()[:, 0]
        assert torch.allclose(torch.tensor(column["p_a"], dtype=torch.float64), p_a, atol=1e-5)
        # the top-5 is A's five likeliest tokens, most likely first, with their probabilities
        best = la[0].exp().topk(5)
        assert [round(p, 6) for _, p in column["top_a"][0]] == [
            round(float(p), 6) for p in best.values
        ]
    s = report["summary"]
    kl_a = torch.tensor(report["columns"]["a"]["kl"], dtype=torch.float64)
    assert s["kl_mean"] == pytest.approx(float(kl_a.mean()), abs=1e-9)
    assert s["kl_max"] == pytest.approx(float(kl_a.max()), abs=1e-9)
    assert s["kl_mean"] <= s["kl_p99"] <= s["kl_max"]
    assert s["flips"] == (report["a"]["token_ids"] != report["b"]["token_ids"])
    assert 0 <= s["speculative"]["greedy_acceptance"] <= 1
    # greedy A: its tokens are its argmax, so B's greedy acceptance is the top-1 agreement
    assert s["speculative"]["greedy_acceptance"] == pytest.approx(s["top1_agreement"])
    assert 0 < s["speculative"]["sampling_acceptance"] <= 1
    # measured: fp32 A with int4 B drafting 4 tokens a step, greedy: A's answer exactly
    m = s["speculative"]["measured"]
    assert m["k"] == 4 and m["mode"] == "greedy" and m["tokens"] == len(report["a"]["token_ids"])
    assert m["matches_a"] is True and m["first_difference"] is None
    assert 0 <= m["token_acceptance"] <= 1 and 0 <= m["acceptance_rate"] <= 1
    assert m["acceptance_rate"] == m["accepted_tokens"] / m["draft_tokens"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted_tokens"] / m["drafts"])
    assert len(m["acceptance_per_pos"]) == len(m["draft_tokens_per_pos"]) == 4
    assert sum(m["draft_tokens_per_pos"]) == m["draft_tokens"]
    assert 1 <= m["predicted_mean_acceptance_length"] <= 5
    assert a.speculator is None and b.speculator is None  # nothing left behind
    assert a.kv.manager.num_free == a.kv.manager.num_blocks


def test_a_against_itself_is_zero_and_the_noise_floor_is_tiny(engines):
    folder, a, _ = engines
    same = load_model(folder, precision="fp32")
    greedy = Side(SamplingParams(max_new_tokens=10))
    report = compare_prompt(a, same, PROMPT, greedy, greedy)
    s = report["summary"]
    assert s["kl_max"] == pytest.approx(0.0, abs=1e-6)
    assert s["top1_agreement"] == 1.0 and not s["flips"]
    assert report["divergence"]["index"] is None
    assert s["speculative"]["sampling_acceptance"] == pytest.approx(1.0, abs=1e-5)
    # the same weights drafting for themselves: every draft accepted, k + 1 tokens a step
    m = s["speculative"]["measured"]
    assert m["token_acceptance"] == m["acceptance_rate"] == 1.0 and m["matches_a"] is True
    assert m["accepted_tokens"] == m["draft_tokens"] > 0
    assert m["predicted_mean_acceptance_length"] == pytest.approx(m["mean_acceptance_length"])
    # A computed token by token instead of in one pass: rounding only
    assert s["noise_kl_mean"] is not None and 0 <= s["noise_kl_mean"] < 1e-6
    assert len(report["columns"]["b"]["noise_kl"]) == len(report["b"]["token_ids"])


def test_decode_steps_score_equals_the_logits_generation_sampled_from(engines):
    """A′ (token by token) is how generation computed A's logits: its argmax is A's greedy
    output, and scoring agrees with a plain forward."""
    _, a, _ = engines
    prompt = a.tokenizer.encode(PROMPT)
    gen = a.generate(prompt, SamplingParams(max_new_tokens=8))
    list(gen)
    ids = gen.result.token_ids
    stepped = score(a, prompt, ids, decode_steps=True)
    assert stepped.argmax(-1).tolist() == ids
    whole = score(a, prompt, ids)
    assert torch.allclose(whole.double(), direct_logprobs(a, prompt, ids), atol=1e-5)
    assert a.kv.manager.num_free == a.kv.manager.num_blocks  # the scratch blocks went back


def test_scoring_uses_the_sides_cache_window(engines):
    _, a, _ = engines
    prompt = a.tokenizer.encode(" ".join(f"t{i}" for i in range(40)))
    ids = [5, 6, 7, 8]
    full = score(a, prompt, ids)
    windowed = score(a, prompt, ids, window=CacheWindow(sink=2, window=8))
    assert not torch.allclose(full, windowed)
    stepped = score(a, prompt, ids, window=CacheWindow(sink=2, window=8), decode_steps=True)
    assert torch.allclose(windowed, stepped, atol=1e-4)


def test_divergence_follows_vllms_rule(engines):
    _, a, b = engines
    hot = Side(SamplingParams(max_new_tokens=16, temperature=1.5, seed=3))
    cold = Side(SamplingParams(max_new_tokens=16))
    report = compare_prompt(a, b, PROMPT, cold, hot, noise=False)
    d = report["divergence"]
    ids_a, ids_b = report["a"]["token_ids"], report["b"]["token_ids"]
    i = d["index"]
    assert i is not None and ids_a[:i] == ids_b[:i] and ids_a[i] != ids_b[i]
    top_b = [t for t, _ in report["columns"]["b"]["top_b"][i]]
    top_a = [t for t, _ in report["columns"]["a"]["top_a"][i]]
    assert d["a_in_b_top"] == (d["a_token"] in top_b)
    assert d["b_in_a_top"] == (d["b_token"] in top_a)
    assert report["summary"]["noise_kl_mean"] is None
    assert 0 <= report["summary"]["speculative"]["measured"]["token_acceptance"] <= 1


def test_measured_speculation_cancels_and_leaves_the_engines_as_they_were(engines):
    _, a, b = engines
    prompt = prompt_ids_for(a, [{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=1)
    free = (a.kv.manager.num_free, b.kv.manager.num_free)

    def cancel() -> None:
        raise CancelledError("cancelled")

    with pytest.raises(CancelledError):
        measure_speculation(a, b, prompt, params, check=cancel)
    m = measure_speculation(a, b, prompt, params)["measured"]
    assert m["mode"] == "sampling" and m["tokens"] == 8 and m["matches_a"] is None
    assert 0 <= m["token_acceptance"] <= 1
    assert a.speculator is None and b.speculator is None
    assert (a.kv.manager.num_free, b.kv.manager.num_free) == free


def test_document_round_trip_and_bad_files(engines):
    _, a, b = engines
    greedy = Side(SamplingParams(max_new_tokens=4))
    report = compare_prompt(a, b, PROMPT, greedy, greedy, noise=False)
    text = json.dumps(document([report]))
    assert read_document(json.loads(text)) == [json.loads(json.dumps(report))]
    older = json.loads(text)  # a file from before speculative decoding was measured
    del older["comparisons"][0]["summary"]["speculative"]["measured"]
    assert read_document(older)[0]["summary"]["speculative"].keys() == {
        "greedy_acceptance", "sampling_acceptance", "mode"
    }  # fmt: skip

    def damaged(change):  # the saved report with one nested value broken
        copy = json.loads(text)
        change(copy["comparisons"][0])
        return copy

    for bad in (
        {},
        {"format": FORMAT, "comparisons": []},
        {"format": FORMAT, "comparisons": [{}]},
        [],
        damaged(lambda c: c.update(a=[])),
        damaged(lambda c: c["b"].update(pieces=[1, 2])),
        damaged(lambda c: c["columns"]["a"].update(kl=c["columns"]["a"]["kl"][:-1])),
        damaged(lambda c: c["columns"]["b"].update(noise_kl=5)),
        damaged(lambda c: c["columns"]["a"]["p_b"].__setitem__(0, "x")),
        damaged(lambda c: c["summary"]["speculative"].update(measured=[])),
        damaged(lambda c: c["summary"]["speculative"]["measured"].update(acceptance_rate="x")),
    ):
        with pytest.raises(InvalidRequestError):
            read_document(bad)


def test_models_that_do_not_share_a_tokenizer_are_refused(engines, tmp_path):
    from tests.conftest import build_tiny_hf, save_tiny

    _, a, _ = engines
    other = load_model(save_tiny(build_tiny_hf("llama", tied=True, vocab_size=300), tmp_path))
    greedy = Side(SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="do not share a tokenizer"):
        compare_prompt(a, other, PROMPT, greedy, greedy, noise=False)
    # a draft model must share the tokenizer too: not measured, and why
    prompt = prompt_ids_for(a, [{"role": "user", "content": PROMPT}])
    result = measure_speculation(a, other, prompt, greedy.params)
    assert "does not share" in result["not_measured"] and "measured" not in result
    assert a.speculator is None


def test_eval_compare_json_is_the_apps_file_format(engines, tmp_path, capsys):
    folder, a, b = engines
    argv = ["eval", "compare", "--model", str(folder), "--a", "fp32", "--b", "int4-g32",
            "--prompt", PROMPT, "--new-tokens", "6", "--json"]  # fmt: skip
    assert main(argv) == 0
    comparisons = read_document(json.loads(capsys.readouterr().out))
    assert len(comparisons) == 1
    greedy = Side(SamplingParams(max_new_tokens=6))
    direct = compare_prompt(a, b, PROMPT, greedy, greedy)
    got = comparisons[0]
    assert got["a"]["token_ids"] == direct["a"]["token_ids"]
    assert got["b"]["token_ids"] == direct["b"]["token_ids"]
    assert got["summary"]["kl_mean"] == pytest.approx(direct["summary"]["kl_mean"], abs=1e-9)
    assert got["divergence"] == direct["divergence"]
    assert math.isfinite(got["summary"]["rms_dp"])
