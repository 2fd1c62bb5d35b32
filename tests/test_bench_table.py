"""``infersight bench --table``: weights read per token, the bandwidth limit, and llama.cpp in a
process of its own (here a stand-in ``llama_cpp`` module speaking the same API)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.bench.report import format_table, peer_type
from engine.bench.speed import BenchConfig
from engine.bench.table import (
    LlamaCppPeer,
    gguf_file_type,
    measure_read_bandwidth,
    run_table,
)
from engine.errors import InfersightError
from engine.loader.load import load_model
from engine.model.inventory import weight_bytes
from engine.quant.embedding import QuantizedEmbedding
from engine.quant.inventory import decode_read_bytes
from engine.store.synthetic_store import gguf_path, write_synthetic
from tests.probed import precisions
from tests.test_gguf_writer import TINY_LLAMA3

FAKE_LLAMA_CPP = textwrap.dedent(
    """
    import time

    class Llama:
        def __init__(self, model_path, n_threads, **kwargs):
            if not model_path.endswith(".gguf"):
                raise ValueError(f"not a GGUF: {model_path}")
            print("llama_model_loader: a line the C library wrote", flush=True)
            self.threads = n_threads

        def reset(self):
            pass

        def generate(self, tokens, temp, reset):
            if tokens == [999]:  # hangs
                time.sleep(60)
            token = len(tokens)
            while True:
                time.sleep(0.001)
                token += 1
                yield token

    def llama_print_system_info():
        return b"AVX2 = 1 | FAKE = 1 "

    class _Params:
        ftype = None

    def llama_model_quantize_default_params():
        return _Params()

    def llama_model_quantize(src, dst, params):  # a copy, with the asked type named in it
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read() + f"ftype {params.ftype}".encode())
        return 0
    """
)


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """This interpreter, with a stand-in ``llama_cpp`` first on its path."""
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return sys.executable


@pytest.mark.parametrize("precision", precisions("fp32", "int8", "int4-g32+head"))
def test_decode_read_bytes_is_every_weight_but_the_embedding_rows(tiny_model_dir, precision):
    folder, _ = tiny_model_dir("llama", True)
    model = load_model(folder, precision=precision).model
    embed = model.embed
    if isinstance(embed, QuantizedEmbedding):  # rows read from the head's tensors: no bytes
        assert decode_read_bytes(model) == weight_bytes(model)
    else:
        assert isinstance(embed, nn.Embedding)
        # A head that reads the embedding's own tensor counts it once, as the head's; a head
        # with a copy of its own (packed, say) leaves the embedding's bytes unread.
        shared = getattr(model.lm_head, "weight", None) is embed.weight
        rows = 0 if shared else embed.weight.numel() * embed.weight.element_size()
        assert decode_read_bytes(model) == weight_bytes(model) - rows


def test_tied_unpacked_head_reads_the_embedding_once(tiny_model_dir):
    folder, _ = tiny_model_dir("llama", True)
    model = load_model(folder, precision="fp32", pack=False).model
    assert model.lm_head.weight is model.embed.weight
    assert decode_read_bytes(model) == weight_bytes(model)


def test_read_bandwidth_is_a_plausible_rate():
    rate = measure_read_bandwidth(mib=16, repeats=2)
    assert 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s


def test_table_rows_are_each_precision_against_its_limit_and_llama_cpp(fake_python, tmp_path):
    # A synthetic model: its folder for the engine, its F16 GGUF for llama.cpp, which
    # requantizes that file to each other type it is asked for.
    folder = write_synthetic(TINY_LLAMA3, tmp_path / "synthetic")
    gguf = gguf_path(folder)
    assert gguf is not None and gguf_file_type(gguf) == "F16"
    report = run_table(
        folder, ["fp32", "int8"], BenchConfig(prompt_len=4, new_tokens=6, repeats=2),
        llama_python=fake_python, gguf=gguf, gguf_types=("F16", "Q8_0"),
    )  # fmt: skip
    rows = report["rows"]
    assert [(r["engine"], r["precision"]) for r in rows] == [
        ("infersight", "fp32"), ("infersight", "int8"), ("llama.cpp", "F16"),
        ("llama.cpp", "Q8_0"),
    ]  # fmt: skip
    best = max(report["bandwidth_gb_s"]) * 1e9
    for r in rows:
        assert r["decode_tok_s"] > 0
        assert r["limit_tok_s"] == pytest.approx(best / (r["read_mib"] * 2**20))
        assert r["fraction"] == pytest.approx(r["decode_tok_s"] / r["limit_tok_s"])
    # F16 ran on the file as written, Q8_0 on llama.cpp's requantization of it (here a copy
    # of its tensors): each row divided by the tensors a token reads, the head's but not an
    # untied embedding's
    from engine.store.gguf_reader import open_gguf

    tensors = {t.name: int(t.n_bytes) for t in open_gguf(gguf).tensors}
    if "output.weight" in tensors:
        del tensors["token_embd.weight"]
    read = sum(tensors.values()) / 2**20
    assert 0.5 * gguf.stat().st_size / 2**20 < read < gguf.stat().st_size / 2**20
    assert rows[2]["read_mib"] == pytest.approx(read) == rows[3]["read_mib"]
    assert rows[0]["read_mib"] > rows[1]["read_mib"]  # int8 reads fewer bytes
    # which head each side reads: ours in the compute dtype (no +head), the peer's its file's
    # (the peer's F16 file, and the fake peer's requantization: a copy of its tensors)
    assert [r["head"] for r in rows] == ["fp32", "bf16", "F16", "F16"]
    text = format_table(report)
    assert " head " in text.splitlines()[2]
    assert "FAKE = 1" in text and "vs llama.cpp Q4_1" not in text
    ours = {line.split()[1]: line for line in text.splitlines() if line.startswith("infersight")}
    assert ours["fp32"].split()[-1] == "-"  # fp32's peer (F32) did not run
    ratio = rows[1]["decode_tok_s"] / rows[3]["decode_tok_s"]
    assert ours["int8"].split()[-2:] == [f"{ratio:.2f}x", "Q8_0"]
    # an eager row of ours says why its steps were not one C call; the verdicts it ran under
    modes = {p: [r["mode"] for r in rows if r["precision"] == p] for p in ("fp32", "int8")}
    for r in rows:
        own_eager = r["engine"] == "infersight" and modes[r["precision"]] == ["eager"]
        assert bool(r["why"]) == own_eager
        assert (f"{r['precision']} ran eager: {r['why']}" in text) == bool(r["why"])
    assert set(report["kernel_verdicts"]) == {"ours", "within_noise", "torch"}


def test_the_table_says_why_a_row_of_ours_ran_eager():
    row = {"engine": "infersight", "precision": "int8+head", "mode": "eager", "read_mib": 129.0,
           "decode_tok_s": 137.1, "limit_tok_s": 347.0, "fraction": 0.4, "head": "int8",
           "why": "decode steps eager (layer 0's o_proj runs torch's kernel)"}  # fmt: skip
    report = {"model": "m", "cpu": "AVX512", "threads": 2, "new_tokens": 128, "repeats": 3,
              "bandwidth_gb_s": [47.1, 46.0], "rows": [row],
              "kernel_verdicts": {"ours": 40, "within_noise": 3, "torch": 2}}  # fmt: skip
    text = format_table(report)
    assert "int8+head ran eager: decode steps eager (layer 0's o_proj runs torch's kernel)" in text
    assert "40 shapes ours (3 within the noise of two timings), 2 torch's" in text


def test_each_precision_is_compared_with_llama_cpps_type_of_the_same_bits():
    assert [peer_type(p) for p in ("int4-g32+head", "int8+head", "fp32", "bf16", "fp16")] == [
        "Q4_1", "Q8_0", "F32", "F16", "F16",
    ]  # fmt: skip


def test_a_peer_that_cannot_start_gives_a_clear_error(tmp_path):
    # This interpreter has no llama_cpp: the peer exits at once.
    with pytest.raises(InfersightError, match=r"llama\.cpp process exited"):
        LlamaCppPeer(sys.executable, tmp_path / "model.gguf", 1)


def test_a_peer_error_is_reported_and_the_peer_lives_on(fake_python, tmp_path):
    peer = LlamaCppPeer(fake_python, tmp_path / "model.gguf", 2)
    try:
        with pytest.raises(InfersightError, match="unknown command"):
            peer._ask("dance")
        timing = peer.run([1, 2, 3], 5)
        assert timing.new_tokens == 5 and timing.decode_s > 0
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_a_peer_that_hangs_is_killed_at_its_deadline(fake_python, tmp_path):
    peer = LlamaCppPeer(fake_python, tmp_path / "model.gguf", 1, timeout_s=1)
    with pytest.raises(InfersightError, match="did not answer 'run' in 1 s"):
        peer.run([999], 4)
    assert peer.proc.poll() is not None  # killed, not left behind


def test_a_peer_refusing_the_model_says_why(fake_python, tmp_path):
    with pytest.raises(InfersightError, match="not a GGUF"):
        LlamaCppPeer(fake_python, tmp_path / "model.bin", 1)
    # (the failed peer was closed: no process of this test is left running)


def test_bench_table_needs_a_model_with_a_gguf_for_llama_cpp(tiny_model_dir, capsys):
    from app.cli.main import main

    folder, _ = tiny_model_dir("llama", True)
    rc = main(["bench", "--model", str(folder), "--table", "fp32", "--llama-cpp", sys.executable])
    assert rc != 0
    err = capsys.readouterr().err
    assert "has none" in err and "--model default" in err and "models synth" in err


def test_a_missing_peer_python_is_refused_before_anything_loads(capsys):
    from app.cli.main import main

    rc = main(["bench", "--table", "fp32", "--llama-cpp", "/no/such/python"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "no such program" in err and "make bench-peers" in err
    with pytest.raises(InfersightError, match="cannot start /no/such/python"):
        LlamaCppPeer("/no/such/python", Path("model.gguf"), 1)


def test_a_c_step_row_takes_its_kernels_only_figure_from_its_own_clocks(tmp_path):
    """Where decode steps run in one C call (engine/kernels/decode_step.py) the row says so,
    and its kernels-only figure is the step's products and attention as the step's own
    clocks timed them: part of each step, so faster than the whole step."""
    from engine.kernels import lowbit, native

    if native.compiler() is None:
        pytest.skip("no C compiler: our CPU kernels are not built here")
    folder = write_synthetic(TINY_LLAMA3, tmp_path / "synthetic")
    with lowbit.choosing("ours"):
        report = run_table(folder, ["int8"], BenchConfig(prompt_len=4, new_tokens=6, repeats=2))
    (row,) = report["rows"]
    assert row["mode"] == "C step"
    assert row["kernels_tok_s"] > row["decode_tok_s"] > 0
    assert "C step" in format_table(report)


def test_weight_bytes_on_a_device_leave_out_what_lies_elsewhere():
    # a GPU model's experts kept on the CPU (--cpu-experts) are not the GPU's weights: the
    # count on a device takes only its tensors (here one layer's MLP moved to the meta device)
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from tests.conftest import TINY

    model = Transformer(ModelConfig.from_dict({"model_type": "llama", **TINY}))
    total = weight_bytes(model)
    mlp = weight_bytes(model.layers[1].mlp)
    model.layers[1].mlp.to("meta")
    assert weight_bytes(model, torch.device("cpu")) == total - mlp > 0
    assert weight_bytes(model) == total
