"""The A/B lab with a server on both sides and no local model (engine/evals/sides.py's
servers_prompt_ids, app/endpoints/remote.py's ServerTokenizer): ``infersight serve`` answering
A greedily and B sampled, the prompt templated and the tokens read back by the server itself;
every figure checked against the same model run here (both sides are it), and a server
without ``/tokenize`` compared as text, with that said."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from engine.core.sampling import SamplingParams
from engine.evals.figures import first_difference
from engine.evals.remote import compare_with_remote
from engine.evals.scoring import score
from engine.evals.sides import prompt_ids_for
from engine.loader.load import load_model
from tests.test_endpoint_ab import GREEDY, MESSAGES, PROMPT, remote
from tests.test_endpoint_ab import strict as strict  # a fixture, shared

SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def fp32(default_model):
    return load_model(default_model)


def test_two_servers_are_compared_token_by_token_by_their_own_tokenizer(server, fp32):
    got = compare_with_remote({"a": remote(server), "b": remote(server)}, MESSAGES, PROMPT,
                              {"a": GREEDY, "b": SAMPLED})  # fmt: skip
    assert got["bounds"]["tokenizer"].startswith("no local model: both servers tokenize")
    prompt = prompt_ids_for(fp32, MESSAGES)
    assert got["prompt_tokens"] == len(prompt)  # the server's template is the model's
    ids = {side: got[side]["token_ids"] for side in "ab"}
    run = fp32.generate(prompt, GREEDY)
    for _ in run:
        pass
    assert ids["a"] == list(run.result.token_ids)  # greedy: the model's own answer
    assert ids["a"] != ids["b"]  # B sampled: where they part is the point
    assert got["divergence"]["index"] == first_difference(ids["a"], ids["b"])
    for side in "ab":  # pieces read back by the server's /detokenize, as the model's own
        text = fp32.tokenizer.decode(ids[side], skip_special_tokens=False)
        assert "".join(got[side]["pieces"]) == text and got[side]["remote"]
    for column in "ab":  # both sides are one model: each scores an answer as it does here
        exact = F.log_softmax(score(fp32, prompt, ids[column]).double(), -1)
        p = [float(exact[i, t].exp()) for i, t in enumerate(ids[column])]
        figures = got["columns"][column]
        scored = len(figures["p_a"])
        assert scored == len(ids[column])
        assert figures["p_a"] == pytest.approx(p, abs=1e-4)
        assert figures["p_b"] == pytest.approx(p, abs=1e-4)
        assert max(figures["kl"]) <= 1e-5  # KL of a model with itself: none


def test_two_servers_one_without_tokenize_are_compared_as_text(server, strict):
    got = compare_with_remote({"a": remote(server), "b": remote(strict)}, MESSAGES, PROMPT,
                              {"a": GREEDY, "b": GREEDY})  # fmt: skip
    assert got["summary"]["text_only"] and got["bounds"]["tokenizer"] == (
        "no local model, and B's server has no /tokenize to check the two tokenizers by"
    )
    assert got["a"]["text"] == got["b"]["text"] and got["divergence"]["char_index"] is None
