"""The tokenizer a GGUF file holds, rebuilt as Hugging Face's ``tokenizer.json`` (byte-level
BPE with the file's pre-tokenization) and ``tokenizer_config.json`` (with the chat template),
and the ids that end a generation.
"""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedModelError
from engine.store.gguf_reader import gguf_array

# Token texts that end a turn or a document in common chat models; llama.cpp treats control
# tokens with these texts as end-of-generation too, even when the file names only one EOS.
_EOG_TEXTS = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "</s>",
    "<end_of_turn>", "<|end_of_text|>",
}  # fmt: skip

# GPT-2's pre-tokenization regex, and the Llama-3 / Qwen2 ones (llama.cpp's definitions).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "gpt-2", "default"):
        return byte_level
    if pre == "smollm":
        # SmolLM's tokenizer splits every digit into its own pre-token before the GPT-2
        # regex (llama.cpp: "\p{N}" first). Without this, "2024" becomes one or two tokens
        # the model never saw in training.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = {"qwen2": _QWEN2_REGEX, "llama-bpe": _LLAMA3_REGEX}.get(pre)
    if regex is None:
        raise UnsupportedModelError(
            f"tokenizer pre-tokenization {pre!r} is not supported; supported: "
            "gpt2, smollm, qwen2, llama-bpe"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def hf_tokenizer(reader: Any, meta: dict[str, Any]) -> tuple[str, dict[str, Any], list[int]]:
    """Build ``tokenizer.json`` text, ``tokenizer_config.json`` and the end-of-generation ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"tokenizer model {kind!r} is not supported; GGUF import supports byte-level BPE "
            "('gpt2') tokenizers"
        )
    tokens = [str(t) for t in gguf_array(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in gguf_array(reader, "tokenizer.ggml.token_type")] or [1] * len(tokens)
    pairs = (str(m).split(" ", 1) for m in gguf_array(reader, "tokenizer.ggml.merges"))
    merges = [(pair[0], pair[1]) for pair in pairs]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    pre_tokenizer = _pre_tokenizer(pre)

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [i for i, t in enumerate(types) if t == 3]  # llama.cpp: CONTROL
    user = [i for i, t in enumerate(types) if t == 4]  # USER_DEFINED
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    if user:
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            eos_ids.append(int(meta[f"tokenizer.ggml.{key}"]))
    eos_ids += [i for i in control if tokens[i] in _EOG_TEXTS]
    eos_ids = sorted(set(eos_ids))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
        "gguf_pre_tokenizer": pre,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = str(template)
    return tok.to_str(), tokenizer_config, eos_ids
