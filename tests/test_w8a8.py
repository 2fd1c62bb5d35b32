"""W8A8 (engine/quant/w8a8.py), its calibration and SmoothQuant's smoothing
(engine/quant/calibration.py, engine/evals/calibrate.py): the int8 × int8 product against the
dequantized float product, which step shapes quantize their activations, smoothing as an exact
rescaling of the float model, calibration files that round-trip and refuse what does not fit,
and ``infersight calibrate`` end to end on a tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.evals.calibrate import ALPHAS
from engine.kernels import gemv, layer_ops, lowbit, lowbit_rows
from engine.loader.load import engine_for, load_model
from engine.loader.weights import load_transformer
from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer
from engine.quant import calibration, w8a8
from engine.quant.calibration import Calibration, CalibrationError, SmoothingPlan
from engine.quant.int8 import Int8Linear
from engine.quant.spec import QuantKind, parse_precision_spec
from engine.quant.w8a8 import W8A8Linear, dequantized_product, quantize_rows

# -- the product -------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "k", "n"), [(17, 64, 24), (40, 40, 72), (33, 136, 8), (64, 576, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_product_is_the_dequantized_product(m, k, n, bias) -> None:
    """Over a decode step's rows, the output is the float64 product of the dequantized int8
    activations (per token) and weights (per channel), rounded once to bf16: the int32 sums
    are exact and only the scales are applied in fp32."""
    gen = torch.Generator().manual_seed(m * k + n)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    layer = W8A8Linear(weight, b, torch.bfloat16, decode_int_mm=False)
    x = torch.randn(m, k, generator=gen).bfloat16()
    got = layer(x)
    want = dequantized_product(x, layer.weight, layer.w_scales)
    if b is not None:
        want = want + layer.bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)


def test_rows_quantize_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 1.0, -50.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 1)
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    assert q[2].abs().max() == 127  # each row's own scale: the large row leaves the others be
    torch.testing.assert_close(q.float() * scale, x, atol=100 / 254, rtol=0)


def test_decode_shapes_keep_weight_only_and_larger_ones_quantize_activations(monkeypatch) -> None:
    """Up to gemv.MAX_ROWS rows (a decode step) the layer is exactly weight-only INT8 unless
    int8 × int8 measured faster there; above, one int8 × int8 product runs."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    layer = W8A8Linear(weight, None, torch.bfloat16, decode_int_mm=False)
    reference = Int8Linear(weight, None, torch.bfloat16)
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda *a: calls.append(a[0].shape) or real(*a))
    small = torch.randn(gemv.MAX_ROWS, 64, generator=gen).bfloat16()
    assert torch.equal(layer(small), reference(small)) and calls == []
    large = torch.randn(gemv.MAX_ROWS + 1, 64, generator=gen).bfloat16()
    layer(large)
    assert calls == [(gemv.MAX_ROWS + 1, 64)]
    every = W8A8Linear(weight, None, torch.bfloat16, decode_int_mm=True)
    every(small)
    assert len(calls) == 2 and "every row count" in every.kernel
    assert isinstance(every.c_product(torch.bfloat16), str)  # the decode step stays eager


def test_smoothing_moves_an_outlier_channel_into_the_weights() -> None:
    """Why smoothing: with one activation channel 60× the others, per-token INT8 activations
    lose the rest of the row; dividing the channels by SmoothQuant's factors (and multiplying
    the weights' columns) makes the same product several times more accurate."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=gen)
    x[:, 7] *= 60
    w = torch.randn(96, 128, generator=gen) * 0.05
    exact = x.double() @ w.double().t()

    def w8a8_error(xs, ws):
        layer = W8A8Linear(ws, None, torch.float32, decode_int_mm=False)
        return (layer(xs).double() - exact).pow(2).mean().sqrt()

    s = calibration.factors(x.abs().amax(0), w.abs().amax(0), 0.5)
    plain, smoothed = w8a8_error(x, w), w8a8_error(x / s, w * s)
    assert smoothed < plain / 3


# -- specs -------------------------------------------------------------------------------


def test_w8a8_specs() -> None:
    spec = parse_precision_spec("w8a8")
    w8a8 = QuantKind(8, activations=True)
    assert spec.parts == {"attn": w8a8, "mlp": w8a8} and w8a8.name == "w8a8"
    assert not spec.smoothed and spec.calibration is None
    sq = parse_precision_spec("w8a8-sq+head")
    assert sq.smoothed and sq.calibration == "self" and sq.parts["head"].name == "w8a8-sq"
    assert parse_precision_spec("w8a8-sq@random").calibration == "random"
    mixed = parse_precision_spec("mixed:attn=w8a8-sq,mlp=w8a8-sq,mlp.0-1=int8")
    assert mixed.block_kind("mlp", 0) == QuantKind(8) and mixed.block_kind("mlp", 2).smooth
    with pytest.raises(InvalidRequestError, match="no calibration name"):
        parse_precision_spec("w8a8-sq@../x")
    with pytest.raises(InvalidRequestError, match="one load takes one"):
        parse_precision_spec("mixed:attn=w8a8-sq@random,mlp=w8a8-sq")


# -- smoothing and calibration files -----------------------------------------------------


def _fake_calibration(folder, cfg: ModelConfig, seed: int = 0) -> Calibration:
    """Statistics of the right shapes, with spread-out channels (a few large): what a
    calibration run keeps, without running one."""
    gen = torch.Generator().manual_seed(seed)
    widths = calibration._widths(cfg)
    act, weight = {}, {}
    for layer in range(cfg.num_layers):
        for module, width in widths.items():
            name = f"layers.{layer}.{module}"
            act[name] = torch.rand(width, generator=gen) * 4 + 0.1
            act[name][:2] *= 20
            weight[name] = torch.rand(width, generator=gen) * 0.3 + 0.01
    return Calibration(act, weight, {"alpha": 0.6}, held=[[3, 4, 5], [6, 7]])


def _engine(model, folder, cfg):
    return engine_for(
        model, Tokenizer.from_folder(folder), cfg, parse_precision_spec("fp32"),
        torch.device("cpu"), name="t", eos_token_ids=[],
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_smoothing_leaves_the_float_models_logits_unchanged(tiny_model_dir, arch) -> None:
    """Smoothing is an exact rescaling before quantization: the float model with every
    block's factors folded in (norms, qkv, v rows and bias, o, gate/up, up rows, down) gives
    the plain float model's logits to fp32 rounding, though its weights changed."""
    folder, _ = tiny_model_dir(arch, False)
    cfg = ModelConfig.from_file(folder / "config.json")
    blocks = {(part, layer) for layer in range(cfg.num_layers) for part in ("attn", "mlp")}
    plan = SmoothingPlan(_fake_calibration(folder, cfg), cfg, blocks)
    cpu = torch.device("cpu")
    plain = load_transformer(folder, cfg, torch.float32, cpu)
    smoothed = load_transformer(folder, cfg, torch.float32, cpu, smoothing=plan)
    for name in ("layers.0.input_norm.weight", "layers.1.mlp.down_proj.weight"):
        before, after = plain.get_parameter(name), smoothed.get_parameter(name)
        assert (before - after).abs().max() > 1e-2 * before.abs().max()
    ids = list(range(3, 40))
    a, b = _engine(plain, folder, cfg), _engine(smoothed, folder, cfg)
    want = a.runner.forward_logits(ids, a.runner.new_cache(len(ids)), 0)
    got = b.runner.forward_logits(ids, b.runner.new_cache(len(ids)), 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def own_folder(tiny_model_dir, tmp_path):
    """A copy of the tiny Llama's folder: calibrations are written into it."""
    folder, _ = tiny_model_dir("llama", False)
    return shutil.copytree(folder, tmp_path / "tiny")


def test_calibration_files_round_trip(own_folder) -> None:
    cfg = ModelConfig.from_file(own_folder / "config.json")
    cal = _fake_calibration(own_folder, cfg)
    cal.save(own_folder, "self")
    back = calibration.load(own_folder, "self", cfg)
    assert back.act.keys() == cal.act.keys() and back.held == [[3, 4, 5], [6, 7]]
    assert back.alphas == dict.fromkeys(calibration.SMOOTHED, 0.6)
    assert all(torch.equal(back.act[k], cal.act[k]) for k in cal.act)
    assert all(torch.equal(back.weight[k], cal.weight[k]) for k in cal.weight)
    assert back.meta["model"] == calibration.model_fingerprint(own_folder)


def test_missing_foreign_and_stale_calibrations_are_refused(own_folder, tiny_model_dir) -> None:
    cfg = ModelConfig.from_file(own_folder / "config.json")
    with pytest.raises(CalibrationError, match="infersight calibrate"):
        load_model(own_folder, precision="w8a8-sq")
    _fake_calibration(own_folder, cfg).save(own_folder, "self")
    assert calibration.load(own_folder, "self", cfg).alphas["mlp.down_proj"] == 0.6
    # another model's statistics, copied in: refused
    other, _ = tiny_model_dir("qwen2", False)
    foreign = shutil.copytree(other, own_folder.parent / "other")
    shutil.copytree(own_folder / "calibration", foreign / "calibration")
    with pytest.raises(CalibrationError, match="other weights"):
        calibration.load(foreign, "self", ModelConfig.from_file(foreign / "config.json"))
    # this model's weights converted again since: stale
    weights = next(own_folder.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"
    weights.write_bytes(bytes(data))
    with pytest.raises(CalibrationError, match="other weights"):
        calibration.load(own_folder, "self", cfg)
    # a file of another format version
    _fake_calibration(own_folder, cfg).save(own_folder, "self")
    meta_path = calibration.files(own_folder, "self")[1]
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(CalibrationError, match="format version"):
        calibration.load(own_folder, "self", cfg)
    # and the load says so without a traceback's worth of anything else
    with pytest.raises(CalibrationError, match="format version"):
        load_model(own_folder, precision="w8a8-sq")


def test_calibrate_writes_statistics_that_w8a8_sq_loads(own_folder, capsys) -> None:
    """``infersight calibrate`` on a tiny model: the model writes its own text, the float
    model reads it, the α sweep runs, and ``w8a8-sq`` then loads and generates; the
    statistics are the largest input magnitudes (norm outputs are never all zero)."""
    from app.cli.main import main

    argv = ["calibrate", "--model", str(own_folder), "--prompts", "2", "--samples", "2",
            "--max-tokens", "48", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == "self" and report["sequences"] == 4
    alphas = report["alphas"]
    assert set(alphas) == set(calibration.SMOOTHED) and set(alphas.values()) <= set(ALPHAS)
    chosen = ",".join(f"{alphas[k]:g}" for k in calibration.SMOOTHED)
    # the kept choice scored lowest of every α tried, one for all or one kind at a time
    assert report["losses"][chosen] == min(v for k, v in report["losses"].items() if k != "float")
    cfg = ModelConfig.from_file(own_folder / "config.json")
    cal = calibration.load(own_folder, "self", cfg)
    assert cal.meta["recipe"]["samples"] == 2 and cal.meta["tokens"] == report["tokens"]
    assert all(v.min() > 0 for k, v in cal.act.items() if k.endswith("qkv_proj"))
    eng = load_model(own_folder, precision="w8a8-sq")
    assert any(isinstance(m, W8A8Linear) for m in eng.model.modules())
    from engine.core.sampling import SamplingParams

    out = list(eng.generate(list(range(3, 30)), SamplingParams(max_new_tokens=4)))
    assert out[-1].finish_reason is not None
    assert main(["calibrate", "--model", str(own_folder), "--prompts", "0"]) == 2
    # α again on the saved statistics: the same choice from the same held text
    capsys.readouterr()
    assert main(["calibrate", "--model", str(own_folder), "--sweep", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alphas"] == alphas


# -- where people look: the sensitivity scan ----------------------------------------------


def test_the_layer_scan_takes_w8a8_as_its_low_format(tiny_model_dir) -> None:
    """``eval scan --low w8a8``: every block scanned with INT8 activations (more error than
    weight-only INT8 on the same block, in sum over the blocks), while ``w8a8-sq``, whose
    smoothing spans a layer's norms and linears, is refused with what to do instead."""
    from engine.evals.sensitivity import scan_formats, scan_sensitivity

    assert scan_formats("w8a8", None) == (QuantKind(8, activations=True), None)
    with pytest.raises(InvalidRequestError, match="scan with w8a8"):
        scan_formats("w8a8-sq", None)
    folder, _ = tiny_model_dir("llama", True)
    text = [(7 * i + 3) % 320 for i in range(48)]
    w8a8 = scan_sensitivity(folder, "w8a8", text_ids=text)
    int8 = scan_sensitivity(folder, "int8", text_ids=text)
    assert len(w8a8.blocks) == len(int8.blocks) > 0
    assert sum(b.kl for b in w8a8.blocks) > sum(b.kl for b in int8.blocks) > 0


def test_the_prefill_table_computes_each_prompt_in_each_precision(tiny_model_dir, monkeypatch):
    """``bench --prefill-table fp32 w8a8``: every repeat computes the whole prompt in each
    precision (nothing found cached), w8a8's through int8 × int8 products, and the first row
    is the reference."""
    from engine.bench import prefill, speed
    from engine.bench.prefill import format_prefill_table, run_prefill_table

    folder, _ = tiny_model_dir("llama", False)
    cached, int_mm = [], []
    run, real = speed.run_ours, torch._int_mm

    def counted(eng, prompt, new_tokens, batch=1):
        # the products of the timed runs only: a load may time int8 × int8 on one row
        with monkeypatch.context() as m:
            m.setattr(torch, "_int_mm", lambda *a: int_mm.append(a[0].shape[0]) or real(*a))
            timing = run(eng, prompt, new_tokens, batch)
        cached.append(timing.cached_prompt_tokens)
        return timing

    monkeypatch.setattr(prefill, "run_ours", counted)
    report = run_prefill_table(folder, ["fp32", "w8a8"], prompt_len=40, repeats=2)
    assert [r["precision"] for r in report["rows"]] == ["fp32", "w8a8"]
    assert report["rows"][0]["vs_first"] == 1.0 and len(cached) == 2 * (1 + 2)
    assert set(cached) == {0} and int_mm and min(int_mm) == 40
    assert "w8a8" in format_prefill_table(report)


@pytest.mark.parametrize("precision", ["w8a8-static", "w8a8-sq-static"])
def test_static_scales_come_from_the_calibration(own_folder, precision) -> None:
    """``-static``: each W8A8 linear takes one activation scale, the calibration's largest
    input magnitude (after smoothing, where smoothed) over 127, and quantizes every token with
    it; the LM head, which the calibration does not read, keeps per-token scales."""
    cfg = ModelConfig.from_file(own_folder / "config.json")
    cal = _fake_calibration(own_folder, cfg)
    cal.save(own_folder, "self")
    eng = load_model(own_folder, precision=precision + "+head")
    blocks = {(part, layer) for layer in range(cfg.num_layers) for part in ("attn", "mlp")}
    plan = SmoothingPlan(cal, cfg, blocks) if "-sq" in precision else None
    for name in calibration.SMOOTHED:
        module = eng.model.get_submodule(f"layers.1.{name}")
        act = cal.act[f"layers.1.{name}"]
        if plan is not None:
            act = act / plan.input_factors(f"layers.1.{name}")
        assert module.act_scale == pytest.approx(float(act.max()) / 127, rel=1e-6)
    assert eng.model.lm_head.act_scale is None
    x = torch.randn(20, cfg.hidden_size) * 1000  # far past the range: saturates at ±127
    layer = eng.model.get_submodule("layers.0.mlp.gate_up_proj")
    y = layer(x.bfloat16()).double()
    limit = 127 * layer.act_scale * (layer.weight.double().abs().sum(1) * layer.w_scales.double())
    assert (y.abs() <= limit * (1 + 2**-7) + 1e-3).all()


def test_compare_hf_runs_transformers_in_fp32_beside_a_w8a8_engine(tiny_model_dir) -> None:
    """``bench --workload mixed --precision w8a8 --compare-hf``: transformers has none of our
    formats, so it runs the model as published (fp32), and the report says so."""
    from engine.bench.report import format_workload_report
    from engine.bench.speed import HFRunner
    from engine.bench.workload import run_workload_bench

    folder, _ = tiny_model_dir("llama", False)
    hf = HFRunner(folder, "w8a8", torch.device("cpu"))
    assert hf.precision == "fp32" and next(hf.model.parameters()).dtype == torch.float32
    report = run_workload_bench(folder, requests=4, batch_sizes=[2], precision="w8a8",
                                compare_hf=True)  # fmt: skip
    assert report["best_vs_best_transformers"]["transformers_precision"] == "fp32"
    assert "transformers' best (static batches of 2, fp32)" in format_workload_report(report)


# -- a prefill's rows through the fused layer ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "h", "inter"), [(40, 64, 96), (17, 70, 44)])  # 70, 44: tails
def test_fused_row_operations_are_the_calls_they_replace(dtype, rows, h, inter) -> None:
    """The norms' fusions give our C norm then torch's quantization bit for bit (ours equals
    torch's: test_lowbit); SiLU · up with its quantization is within an int8 step of torch's
    F.silu (the exp is ours), the scales within one rounding."""
    lib = layer_ops.library()
    norms = layer_ops.CNorms(lib)
    gen = torch.Generator().manual_seed(rows + h)
    x = (torch.randn(rows, h, generator=gen) * 3).to(dtype)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
    acc = torch.randint(-(2**16), 2**16, (rows, h), generator=gen, dtype=torch.int32)
    sx, sw = torch.rand(rows, 1, generator=gen) * 1e-3, torch.rand(h, generator=gen) * 1e-2
    bias = torch.randn(h, generator=gen)
    for fixed in (None, 0.05):
        got = layer_ops.w8a8_norm_quantize(lib, x, w, 1e-5, fixed)
        want = lowbit_rows.quantize_rows_reference(norms.rms_norm(x, w, 1e-5), fixed)
        assert all(map(torch.equal, got, want))
        summed, q, s = layer_ops.w8a8_add_norm_quantize(lib, acc, sx, sw, bias, x, w, 1e-5, fixed)
        y = lowbit_rows.scale_rows_reference(acc, sx, sw, bias, dtype)
        normed, want_sum = norms.add_rms_norm(y, x, w, 1e-5)
        assert torch.equal(summed, want_sum) and torch.equal(summed, x + y)
        assert all(map(torch.equal, (q, s), lowbit_rows.quantize_rows_reference(normed, fixed)))
        acc2 = torch.randint(-(2**16), 2**16, (rows, 2 * inter), generator=gen, dtype=torch.int32)
        sw2 = torch.rand(2 * inter, generator=gen) * 1e-2
        q, s = layer_ops.w8a8_silu_quantize(lib, acc2, sx, sw2, dtype, fixed)
        wq, ws = layer_ops.w8a8_silu_quantize_reference(acc2, sx, sw2, dtype, fixed)
        assert (q.int() - wq.int()).abs().max() <= 1
        assert (q != wq).float().mean() < 0.02
        torch.testing.assert_close(s, ws, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=0)


# qwen2: q/k/v biases; qwen3: per-head q/k norms
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_fused_layer_computes_what_the_layer_computes(tiny_model_dir, arch) -> None:
    """A prefill through the fused W8A8 layers (every layer takes it, every layer's call
    counted) gives the unfused layers' logits within what SiLU's exp moves (an int8 step
    here and there) and the same greedy token at every position; a decode step's rows (up to
    gemv.MAX_ROWS) and a hooked layer take the layers' own code."""
    folder, _ = tiny_model_dir(arch, False)
    engine = load_model(folder, precision="w8a8", device="cpu")
    model = engine.model
    assert w8a8.fuse_layers(model, layer_ops.library()) == model.cfg.num_layers
    runs = []
    fused = model.layers[0].fused

    def counted(layer, *args):
        out = fused(layer, *args)
        if out is not None:
            runs.append(layer.attn.layer)
        return out

    for layer in model.layers:
        layer.fused = counted
    ids = list(range(3, 3 + gemv.MAX_ROWS + 24))
    runner = engine.runner
    got = runner.forward_logits(ids, runner.new_cache(len(ids)), 0)
    assert sorted(runs) == list(range(model.cfg.num_layers))
    for layer in model.layers:
        layer.fused = None
    want = runner.forward_logits(ids, runner.new_cache(len(ids)), 0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
    for layer in model.layers:
        layer.fused = counted
    runs.clear()
    short = ids[: gemv.MAX_ROWS]
    runner.forward_logits(short, runner.new_cache(len(short)), 0)
    handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    runner.forward_logits(ids, runner.new_cache(len(ids)), 0)
    handle.remove()
    assert runs == [i for i in range(model.cfg.num_layers) if i != 1]  # the short step: none


# -- the int8 × int8 product on AMX tiles, where the CPU has them ------------------------------


def _amx() -> object:
    from engine.kernels import amx

    found = amx.library()
    if not found.available:
        pytest.skip(f"our AMX GEMM does not run here: {found.why}")
    return found


@pytest.mark.parametrize(("m", "n", "k"), [(512, 96, 576), (77, 32, 64), (33, 64, 1536)])
def test_the_amx_product_is_torch_int_mm(m, n, k) -> None:
    """Where the CPU has AMX-INT8 (cpu probe: the build's ISA), our tile GEMM gives
    torch._int_mm's int32 sums bit for bit, rows in whole 32s of tiles or not."""
    from engine.kernels import amx

    lib = _amx()
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    assert amx.fits(n, k) and not amx.fits(n + 16, k) and not amx.fits(n, k + 32)
    packed, sums = amx.pack(w, lib), torch._int_mm(x, w.t())
    assert torch.equal(amx.gemm(x, packed, n, lib), sums)
    # scaled in the tiles' epilogue: scale_rows's values, with a bias and a residual added
    sx, sw = torch.rand(m, 1, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-2
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        res = torch.randn(m, n, generator=gen).to(dtype)
        for b, r in ((None, None), (bias, res)):
            got = amx.gemm_scaled(x, packed, n, sx, sw, b, dtype, r, lib)
            assert torch.equal(got, lowbit_rows.scale_rows_reference(sums, sx, sw, b, dtype, r))
        # SiLU · up and its quantization as the tiles are stored: the C call's on the sums
        for fixed in (None, 0.05):
            got = amx.silu_quantize(x, packed, n // 2, sx, sw, dtype, fixed, lib)
            want = layer_ops.w8a8_silu_quantize(layer_ops.library(), sums, sx, sw, dtype, fixed)
            assert all(map(torch.equal, got, want))


def test_a_w8a8_layer_takes_the_amx_product_where_it_measured_faster(monkeypatch, tmp_path):
    """The AMX GEMM is timed once per shape against torch._int_mm (kept in kernels.json): a
    layer faster on it packs its weights and gives the _int_mm layer's output exactly; one
    slower keeps _int_mm and packs nothing; a shape that does not tile is never timed."""
    _amx()
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    monkeypatch.setenv(lowbit.ENV, "auto")
    timings = []

    def timed(n, k):
        timings.append((n, k))
        return lowbit.Timing(ours_ms=1.0 if n == 64 else 3.0, torch_ms=2.0)

    monkeypatch.setattr(w8a8, "time_prefill", timed)
    gen = torch.Generator().manual_seed(0)
    make = lambda n, k: W8A8Linear(torch.randn(n, k, generator=gen), None, torch.bfloat16,  # noqa: E731
                                   decode_int_mm=False)  # fmt: skip
    fast, slow, odd = make(64, 128), make(96, 128), make(48, 128)
    assert timings == [(64, 128), (96, 128)]
    assert fast.amx_weight is not None and "AMX" in fast.kernel
    assert slow.amx_weight is None and odd.amx_weight is None and "AMX" not in slow.kernel
    assert fast.nbytes == slow.nbytes * 64 // 96 + 64 * 128  # the packed copy counted
    x = torch.randn(40, 128, generator=gen).bfloat16()
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda *a: calls.append(1) or real(*a))
    got = fast(x)
    assert calls == []  # on the tiles
    fast.amx_weight = None
    assert torch.equal(got, fast(x)) and calls == [1]  # _int_mm's output, exactly


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fused_layer_on_amx_gives_the_int_mm_layers_logits(tiny_model_dir, arch, monkeypatch):
    """Where AMX runs, a W8A8 model whose layers took the AMX GEMM (forced faster here) gives,
    through the fused prefill layers, the logits of the same model on torch._int_mm, to the
    bit: the int32 sums are exact either way and every later step computes the same values."""
    _amx()
    monkeypatch.setenv(lowbit.ENV, "auto")
    monkeypatch.setattr(w8a8, "time_prefill", lambda n, k: lowbit.Timing(1.0, 2.0))
    folder, _ = tiny_model_dir(arch, False, hidden_size=64, intermediate_size=128)
    engine = load_model(folder, precision="w8a8", device="cpu")
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert linears and all(m.amx_weight is not None for m in linears), [m.kernel for m in linears]
    assert w8a8.fuse_layers(model, layer_ops.library()) == model.cfg.num_layers
    ids = list(range(3, 3 + gemv.MAX_ROWS + 30))
    runner = engine.runner
    got = runner.forward_logits(ids, runner.new_cache(len(ids)), 0)
    for m in linears:
        m.amx_weight = None
    assert torch.equal(got, runner.forward_logits(ids, runner.new_cache(len(ids)), 0))
