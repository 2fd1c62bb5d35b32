"""Speculative decoding: a cheap drafter proposes a few tokens, the model verifies them in one
forward pass, and the rule below keeps exactly the tokens the model itself would have produced.

**The rule** (Leviathan et al. 2023; Chen et al. 2023). The drafter proposes ``x₁ … x_k`` with
distributions ``q₁ … q_k`` (a lookup drafter's proposals are certain: ``q`` is one-hot). One
forward of the target over ``[last token, x₁ … x_k]`` gives its distributions ``p₁ … p_{k+1}``
(after the request's own penalty, temperature and filters, so "the target's distribution" is
exactly what plain sampling draws from). Draft ``x_j`` is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the token is drawn from
``normalise(max(0, p_j − q_j))`` and the step ends; if every draft is accepted a *bonus* token
is drawn from ``p_{k+1}``. Each output token is then distributed exactly as ``p``, so the
output distribution does not change. Greedy requests take the longest prefix of drafts that
equal the target's argmax, then the target's own next token: token for token what plain
greedy decoding gives. Either way a step yields between 1 and k+1 tokens.

**Where it runs.** The engine's step (:mod:`engine.core.step`) reaches it through one seam,
:class:`~engine.speculative.speculator.Speculator`: it asks for each decoding sequence's k
(``plan``), the scheduler reserves KV slots for those k tokens beside the sequence's one (it
stays the only owner of batches and blocks), the drafter proposes (``drafts_for``), the model
verifies every sequence's drafts in the one forward pass of the step (a verifying sequence is
a chunk of 1 + k tokens in the flattened batch; ``verify`` applies the rule), and the engine
rolls the KV cache back to the accepted tokens, freeing the blocks that held only rejected
ones. :func:`engine.load` wires it into the engines it makes (:mod:`engine.loader.drafter`:
building a drafter may load a model).

The modules: :mod:`~engine.speculative.config` (``--speculative``), :mod:`~engine.speculative.rule`
(the acceptance rule), :mod:`~engine.speculative.drafters`, :mod:`~engine.speculative.adaptive`
(adaptive k and its costs), :mod:`~engine.speculative.speculator` (the state and the seam).

**Drafters** (one interface, ``Drafter``):

* ``LookupDrafter``, prompt lookup: the longest recent n-gram that ends the sequence is
  looked up earlier in it, and the tokens that followed it there are proposed. No model, no
  cost; large gains where the answer copies its input (editing code, summarising), none on
  free prose, where it rarely finds a match and so rarely proposes anything.
* ``ModelDrafter``, a model with the same tokenizer and a KV pool of its own: the same
  weights at a lower precision (*self-speculation*: ``self:int4-g32+head`` drafting for
  fp32), or a separate smaller model.

**Adaptive k** (``AdaptiveK``): per sequence, the acceptance rate α is estimated from its
recent steps, and k is the one that maximises the expected tokens per step
``(1 − α^(k+1)) / (1 − α)`` per unit of cost ``1 + c_verify(k) + k·c_draft``, both measured on
this machine when speculation starts (``measure_costs``): ``c_verify(k)`` what verifying k
drafts adds to a decode step, ``c_draft`` a draft model's forward over the target's. k = 0
switches speculation off for the sequence (it probes again after a while); a batch large
enough that verification no longer rides on memory bandwidth (more than
``max_verify_tokens`` tokens in all) lowers every k, and switches it off.

**Instruments** (``SpecStats``) use vLLM's ``spec_decode_*`` names: drafts, draft tokens,
accepted tokens, accepted tokens per position, and the time spent drafting and verifying.
"""
