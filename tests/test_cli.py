"""The command line: bad input gives one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli.main import main
from engine.loader.load import load_model
from tests.conftest import build_tiny_hf
from tests.gguf_factory import write_gguf


@pytest.fixture()
def tiny(tiny_model_dir, tmp_path) -> Path:
    folder, _ = tiny_model_dir("llama", True)
    copy = tmp_path / "tiny"
    shutil.copytree(folder, copy)
    return copy


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("infersight: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


def test_generate_json_on_a_tiny_model(capsys, tiny):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1 t2 t3",
                           "--max-new-tokens", "5", "--json")  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"prompt_ids", "token_ids", "text", "finish_reason", "ttft_s", "tpot_s"}
    assert result["prompt_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"


def test_missing_model_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_clean_error(code, err, "does not exist")


def test_unsupported_architecture_in_config(capsys, tiny):
    config = json.loads((tiny / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tiny / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "'gpt_neox' is not supported", "llama")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_truncated_or_corrupt_safetensors(capsys, tiny, damage):
    weights = tiny / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"\xff" * 16 + data[16:])
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "model.safetensors is truncated or corrupt")


def test_missing_tensor_is_named(capsys, tiny):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tiny / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "layers.1.mlp.gate_up_proj.weight")


@pytest.mark.parametrize(
    ("arch", "override", "needle"),
    [("gpt2", None, "'gpt2' model"), ("llama", "IQ4_XS", "tensor type(s) IQ4_XS")],
)
def test_import_gguf_refuses_unsupported_files(capsys, tmp_path, arch, override, needle):
    hf = build_tiny_hf("llama", tied=True, hidden_size=64, intermediate_size=128)
    src = write_gguf(hf, tmp_path / "m.gguf", arch=arch, tensor_type_override=override)
    code, _, err = run_cli(capsys, "import-gguf", str(src), str(tmp_path / "out"))
    assert_clean_error(code, err, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "t1 " * 300], "context is 256"),
        (["--prompt", "t1", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "t1", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "t1", "--top-p", "1.01"], "top_p must be in (0, 1]"),
        (["--prompt", "t1", "--top-k", "-3"], "top_k must be >= 0"),
        (["--prompt", "t1", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--prompt", "t1", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["--chat", "hello"], "no chat template"),
    ],
)
def test_bad_requests(capsys, tiny, args, needle):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), *args)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize("port", ["80", "70000"])
def test_app_refuses_a_serve_port_out_of_range_before_opening(capsys, port):
    code, _, err = run_cli(capsys, "app", "--serve", port)
    assert_clean_error(code, err, f"--serve takes a port from 1024 to 65535, not {port}")


def test_tokenize_reads_lines_from_stdin(capsys, monkeypatch, tiny):
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BytesIO(b"t5 t6\nt7\n"), encoding="utf-8")
    )
    from app.cli import run as cli_run

    monkeypatch.setattr(cli_run, "_stdin_text", lambda: sys.stdin)
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(tiny))
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == [[5, 6], [7]]


def test_real_process_prints_no_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "generate",
            "--model",
            str(tmp_path / "x"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("infersight: error: ")
    assert "Traceback" not in done.stderr


def test_help_is_fast_and_imports_no_torch():
    code = (
        "import sys; from app.cli.main import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def step_times(monkeypatch) -> list[tuple[float, float]]:
    """``(start, end)`` of every engine step that gave a token, from outside the engine."""
    from engine.core.engine import LLMEngine

    out: list[tuple[float, float]] = []
    real = LLMEngine.step

    def step(self: LLMEngine) -> list:
        started = time.perf_counter()
        events = real(self)
        if any(e.token_id is not None for e in events):
            out.append((started, time.perf_counter()))
        return events

    monkeypatch.setattr(LLMEngine, "step", step)
    return out


def bench_span(row: dict, new_tokens: int) -> float:
    """A ``--repeats 1`` row's rates are its one run's counts over its own times: the prompt
    over the TTFT, the tokens after the first over their gaps. Returns the run's span."""
    assert row["new_tokens"] == new_tokens
    assert row["prefill_tok_s"] * row["ttft_ms"] / 1e3 == pytest.approx(row["prompt_len"])
    assert row["decode_tok_s"] * row["tpot_ms"] / 1e3 == pytest.approx(1.0)
    return (row["ttft_ms"] + (new_tokens - 1) * row["tpot_ms"]) / 1e3


def test_bench_single_and_mixed_workloads_report_json(capsys, tiny, monkeypatch):
    steps = step_times(monkeypatch)
    started = time.perf_counter()
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--new-tokens", "8",
                           "--repeats", "1", "--json")  # fmt: skip
    elapsed = time.perf_counter() - started
    assert code == 0
    report = json.loads(out)
    (result,) = report["results"]
    assert result["engine"] == "infersight"
    assert bench_span(result, 8) <= elapsed  # within the command's own time
    # the timed run is the last: one step per token (batch 1); its TTFT spans at least the
    # first step, its decode at least the seven steps after it (the outside clock's times)
    assert len(steps) >= 8
    first, *rest = steps[-8:]
    assert result["ttft_ms"] / 1e3 >= first[1] - first[0]
    assert 7 * result["tpot_ms"] / 1e3 >= rest[-1][1] - rest[0][0]

    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed",
                           "--requests", "6", "--max-batch-size", "1", "3", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    rows = {r["max_batch_size"]: r for r in report["results"]}
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert row["prompt_tokens"] == rows[1]["prompt_tokens"]  # the same seeded workload
        assert 0 <= row["mean_kv_waste"] < 1 and 0 < row["peak_kv_usage"] <= 1
    assert set(report["speedup_vs_batch1"]) == {"1", "3"}  # JSON object keys are strings


def test_bench_mixed_with_a_shared_prefix_runs_prefix_caching_off_and_on(capsys, tiny):
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed",
                           "--requests", "5", "--max-batch-size", "4", "--shared-prefix", "40",
                           "--prefix-cache", "both", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    off, on = report["results"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert off["output_tokens"] == on["output_tokens"] and off["cached_prompt_tokens"] == 0
    # the first request computes the 40-token prefix; the four others share its two full
    # blocks of 16 (they wait for them rather than compute them too)
    assert on["cached_prompt_tokens"] == 4 * 32
    assert set(report["prefix_cache_on_vs_off"]) == {"4"}


def test_bench_chat_reuses_earlier_turns_and_replies_alike(capsys, default_model):
    code, out, _ = run_cli(capsys, "bench", "--workload", "chat", "--turns", "3",
                           "--message-tokens", "24", "--reply-tokens", "3",
                           "--system-tokens", "20", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["cached_tokens"] == 0
    for before, t in itertools.pairwise(turns):
        assert t["cached_tokens"] + t["computed_tokens"] == t["prompt_tokens"]
        # at least every full block of the last turn's prompt is reused
        assert t["cached_tokens"] >= before["prompt_tokens"] // 16 * 16
    assert report["replies_identical"]
    assert set(report["last_vs_first_ttft"]) == {"off", "on"}


def test_serve_refuses_a_port_in_use_before_loading_anything(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        code, _, err = run_cli(capsys, "serve", "--model", "/nonexistent", "--port", port)
    assert_clean_error(code, err, f"cannot listen on 127.0.0.1:{port}", "--port")
    code, _, err = run_cli(capsys, "serve", "--max-waiting", "0")
    assert_clean_error(code, err, "--max-waiting must be at least 1")
    code, _, err = run_cli(capsys, "serve", "--port", "70000")
    assert_clean_error(code, err, "--port must be 1 to 65535 (or 0: any free port)")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shared-prefix", "500"], "leaves no room for prompts"),
        (["--max-batch-size", "0"], "--max-batch-size values must be at least 1"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--max-tokens-per-step", "0"], "max_tokens_per_step must be >= 1"),
        (["--kv-memory", "-5"], "kv_memory must be > 0"),
        (["--cache-window", "0"], "--cache-window must be >= 1"),
    ],
)
def test_bench_rejects_bad_limits(capsys, tiny, args, needle):
    code, _, err = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed", *args)
    assert_clean_error(code, err, needle)


def test_bench_compare_hf_on_a_tiny_model(capsys, tiny):
    started = time.perf_counter()
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--new-tokens", "6",
                           "--repeats", "1", "--compare-hf", "--json")  # fmt: skip
    elapsed = time.perf_counter() - started
    assert code == 0
    report = json.loads(out)
    ours, theirs = report["results"]
    assert (ours["engine"], theirs["engine"]) == ("infersight", "transformers")
    # each row is its own run's counts over its times, the two runs within the command's time
    assert bench_span(ours, 6) + bench_span(theirs, 6) <= elapsed
    assert report["ratio_decode"] == pytest.approx(ours["decode_tok_s"] / theirs["decode_tok_s"])
    assert report["ratio_prefill"] == pytest.approx(ours["prefill_tok_s"] / theirs["prefill_tok_s"])
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed",
                           "--requests", "4", "--max-batch-size", "2", "--compare-hf",
                           "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    hf_row = next(r for r in report["results"] if r["engine"] == "transformers")
    assert hf_row["output_tokens"] == report["results"][0]["output_tokens"]
    assert set(report["ratio_vs_transformers"]) == {"2"}


# -- the model's default sampling and the device --------------------------------------------


def _with_generation_config(folder: Path, **keys: object) -> Path:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **keys}))
    return folder


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, {"temperature": 0.0, "top_k": 0, "top_p": 1.0}),  # transformers: greedy
        ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.0, "top_k": 0}),
        # do_sample with keys left out: transformers' defaults (top-k 50, top-p 1)
        ({"do_sample": True, "temperature": 0.6}, {"temperature": 0.6, "top_k": 50, "top_p": 1}),
        (
            {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.05},
            {"temperature": 0.2, "top_k": 0, "top_p": 0.9, "min_p": 0.05},
        ),
        ({"do_sample": True, "top_p": 0}, {"temperature": 0.0, "top_p": 1.0}),  # bad: ignored
        ({"repetition_penalty": 1.2, "max_new_tokens": 9}, {"temperature": 0.0,
                                                            "repetition_penalty": 1.2,
                                                            "max_new_tokens": 9}),
    ],
)  # fmt: skip
def test_generation_config_sampling_reads_it_as_transformers_does(tmp_path, keys, expected):
    from engine.loader.generation_config import generation_config_sampling

    defaults = generation_config_sampling(_with_generation_config(tmp_path, **keys))
    assert {k: defaults[k] for k in expected} == expected
    assert defaults.get("max_new_tokens") == expected.get("max_new_tokens")


def test_sampling_defaults_come_from_the_model_and_flags_override_one_key(
    capsys, monkeypatch, tiny
):
    from engine.core.engine import LLMEngine

    _with_generation_config(tiny, do_sample=True, temperature=0.6, top_p=0.8, max_new_tokens=4)
    seen = []
    real_generate = LLMEngine.generate

    def spy(self, prompt_ids, params):
        seen.append(params)
        return real_generate(self, prompt_ids, params)

    monkeypatch.setattr(LLMEngine, "generate", spy)
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1 t2",
                           "--seed", "1", "--json")  # fmt: skip
    assert code == 0 and len(json.loads(out)["token_ids"]) <= 4
    p = seen[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_new_tokens) == (0.6, 50, 0.8, 0, 4)
    code, _, _ = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1 t2",
                         "--temperature", "0", "--top-k", "5", "--max-new-tokens", "2")  # fmt: skip
    p = seen[-1]
    assert code == 0 and p.greedy and (p.top_k, p.top_p, p.max_new_tokens) == (5, 0.8, 2)


def test_without_generation_config_sampling_is_greedy(capsys, monkeypatch, tiny):

    (tiny / "generation_config.json").unlink(missing_ok=True)
    engine = load_model(tiny)
    assert engine.default_sampling["temperature"] == 0 and engine.default_sampling["top_k"] == 0
    runs = [run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1 t2 t3",
                    "--max-new-tokens", "6", "--json") for _ in range(2)]  # fmt: skip
    tokens = [json.loads(out)["token_ids"] for _, out, _ in runs]
    assert runs[0][0] == 0 and tokens[0] == tokens[1]  # greedy: the same tokens twice


def test_device_auto_resolves_and_a_missing_device_is_refused(capsys, tiny):
    import torch

    from app.loading import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1",
                           "--device", "cuda:99")  # fmt: skip
    assert_clean_error(code, err, "'cuda:99'")
    assert "not available" in err or "does not exist" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1",
                           "--device", "gpu")  # fmt: skip
    assert_clean_error(code, err, "unknown device 'gpu'")
    for argv in (["chat"], ["generate", "--prompt", "x"], ["bench"], ["app"],
                 ["eval", "ppl"], ["eval", "compare", "--b", "int8"]):  # fmt: skip
        from app.cli.main import build_parser

        assert build_parser().parse_args(argv).device == "auto"


def test_generate_loads_a_gguf_like_the_app_does(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path / "home"))
    hf = build_tiny_hf("llama", tied=True, hidden_size=64, intermediate_size=128)
    src = write_gguf(hf, tmp_path / "tiny-chat.gguf", arch="llama")
    for _ in range(2):  # imported into the store once, reused after
        code, out, _ = run_cli(capsys, "generate", "--model", str(src), "--chat", "hello",
                               "--max-new-tokens", "3", "--json")  # fmt: skip
        assert code == 0 and json.loads(out)["prompt_ids"]
    assert (tmp_path / "home" / "models" / "tiny-chat" / "config.json").is_file()


def test_chat_and_cli_do_not_import_each_other():
    code = "import sys, app.cli.chat; print('app.cli.main' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slo", "nonsense"], "cannot read the SLO 'nonsense'"),
        (["--users", "0"], "users must be >= 1"),
        (["--mode", "poisson", "--rate", "-1"], "rate must be > 0"),
        (["--kv-blocks", "0"], "--kv-blocks values must be at least 1"),
        (["--documents", "0.9", "--conversations", "0.5"], "shares must sum to <= 1"),
    ],
)
def test_tune_rejects_bad_settings_before_loading(capsys, args, needle):
    code, _, err = run_cli(capsys, "tune", "--model", "/nonexistent", *args)
    assert_clean_error(code, err, needle)


def test_the_replicas_take_the_serve_commands_own_options_and_defaults():
    """Ray's replicas read `infersight serve`'s options from below the command
    (app.cli.options): the same names and defaults as the command's parser gives."""
    from app.cli.main import build_parser
    from app.cli.options import serve_defaults

    parsed = vars(build_parser().parse_args(["serve"]))
    assert parsed.pop("handler").__name__ == "cmd_serve"
    assert serve_defaults() == parsed


# -- torch's CPU allocator ----------------------------------------------------------------------


def test_the_cpu_allocator_is_asked_for_huge_pages_unless_the_user_set_it() -> None:
    from app.cli.common import THP_ENV, configure_cpu_allocator

    absent: dict[str, str] = {}
    assert configure_cpu_allocator(absent, "linux") == "1" and absent == {THP_ENV: "1"}
    theirs = {THP_ENV: "0"}
    assert configure_cpu_allocator(theirs, "linux") == "0" and theirs == {THP_ENV: "0"}
    elsewhere: dict[str, str] = {}
    assert configure_cpu_allocator(elsewhere, "darwin") is None and not elsewhere


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages on this machine",
)
def test_torch_given_the_setting_asks_for_huge_pages_for_a_large_tensor() -> None:
    """The setting does what it is for, in a torch of its own (read as torch loads): the
    mapping that holds a 64 MiB tensor is advised for huge pages (its "hg" flag, whether or not
    the kernel has free 2 MiB pages to give just then), and without the setting it is not."""
    from app.cli.common import THP_ENV, configure_cpu_allocator

    probe = (
        "import torch\n"
        "x = torch.ones(64 << 20, dtype=torch.uint8); at = x.data_ptr(); inside = False\n"
        "for line in open('/proc/self/smaps'):\n"
        "    head = line.split()[0]\n"
        "    if '-' in head and not head.endswith(':'):\n"
        "        lo, hi = (int(v, 16) for v in head.split('-')); inside = lo <= at < hi\n"
        "    elif inside and head == 'VmFlags:':\n"
        "        print('hg' in line.split()[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != THP_ENV}
    without = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
    configure_cpu_allocator(env, sys.platform)
    given = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert given.stdout.split() == ["True"] and without.stdout.split() == ["False"]
