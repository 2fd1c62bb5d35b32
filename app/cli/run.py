"""``infersight generate``, ``tokenize`` and ``chat``: a model run on prompts from the
command line, stdin or the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli.common import load_engine, progress_printer, sampling_params
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.core.structured import Constraint


def json_schema(path: str | None) -> Constraint | None:
    """``--json-schema FILE``'s constraint (its JSON checked before the model loads)."""
    from engine.core.structured import Constraint  # torch: not at --help

    if path is None:
        return None
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the JSON schema {path}: {exc.strerror}") from None
    return Constraint.json_schema(text)


def cmd_generate(args: argparse.Namespace) -> int:
    sampling_params(args)  # check the flags before loading anything
    if (args.prompt if args.prompt is not None else args.chat) == "":
        raise InvalidRequestError("the prompt is empty; give some text to continue")
    constraint = json_schema(args.json_schema)
    engine = load_engine(args)
    params = replace(sampling_params(args, engine.default_sampling), constraint=constraint)
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        prompt_ids = engine.chat_prompt_ids(messages)
    else:
        prompt_ids = engine.tokenizer.encode_prompt(args.prompt)
    generation = engine.generate(prompt_ids, params)
    for event in generation:
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps(generation.result.as_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if constraint is not None:  # what holding it to the schema cost
        grammars = engine.grammars
        per_step = grammars.mask_s / max(grammars.mask_steps, 1) * 1e3
        print(f"grammar mask: {per_step:.2f} ms/step over {grammars.mask_steps} steps",
              file=sys.stderr)  # fmt: skip
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from app.loading import resolve_model_folder
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model_folder(args.model, progress_printer()))
    try:
        for line in _stdin_text():
            print(json.dumps(tokenizer.encode(line.rstrip("\n"))), flush=True)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"stdin is not valid UTF-8 ({exc}); convert it first") from exc
    return 0


def _stdin_text() -> Any:
    """stdin decoded as strict UTF-8, whatever the locale says."""
    return open(sys.stdin.fileno(), encoding="utf-8", errors="strict", closefd=False)


def cmd_chat(args: argparse.Namespace) -> int:
    from app.cli.chat import run_chat

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sampling_params(args)  # check the flags before loading anything
    engine = load_engine(args)
    return run_chat(engine, sampling_params(args, engine.default_sampling), system=args.system)
