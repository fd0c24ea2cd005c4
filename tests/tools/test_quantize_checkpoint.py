"""tools/quantize_checkpoint.py: argument handling, ModelOpt config assembly, FP8 export on CPU."""

import json
import os

import pytest
import torch

from tests.tools._load import load_tool

qc = load_tool("quantize_checkpoint")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from hapo_megatron.data import build_char_tokenizer
    from hapo_megatron.models import tiny_hf_config

    path = str(tmp_path_factory.mktemp("quant") / "model")
    tok = build_char_tokenizer(path)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        tiny_hf_config("llama", vocab_size=len(tok))).save_pretrained(path)
    return path


def _args(**kw):
    argv = ["--model", kw.pop("model"), "--out", kw.pop("out")]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return qc.build_parser().parse_args(argv)


def test_check_args(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    qc.check_args(_args(model=str(model), out=str(tmp_path / "o")))
    with pytest.raises(ValueError, match="--calib-size"):
        qc.check_args(_args(model=str(model), out=str(tmp_path / "o"), calib_size=0))
    with pytest.raises(ValueError, match="--batch-size"):
        qc.check_args(_args(model=str(model), out=str(tmp_path / "o"), batch_size=0))
    with pytest.raises(ValueError, match="does not exist"):
        qc.check_args(_args(model=str(tmp_path / "nope"), out=str(tmp_path / "o")))
    with pytest.raises(ValueError, match="--calib-data"):
        qc.check_args(_args(model=str(model), out=str(tmp_path / "o"), calib_data="x.parquet"))
    out = tmp_path / "full"
    out.mkdir()
    (out / "f").write_text("x")
    with pytest.raises(ValueError, match="--overwrite"):
        qc.check_args(_args(model=str(model), out=str(out)))
    qc.check_args(_args(model=str(model), out=str(out), overwrite=True))
    with pytest.raises(SystemExit):
        qc.build_parser().parse_args(["--model", "m", "--out", "o", "--qformat", "int3"])
    assert qc.main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2


def test_calibration_texts(tmp_path):
    texts = qc.calibration_texts([], None, 11)
    assert len(texts) == 11 and texts[8] == qc.BUILTIN_CALIBRATION[0]
    txt = tmp_path / "c.txt"
    txt.write_text("a\n\nb\nc\n")
    assert qc.calibration_texts([str(txt)], None, 2) == ["a", "b"]


def test_quant_config_adds_kv_cache_rules():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    base = qc.quant_config(mtq, "fp8")
    with_kv = qc.quant_config(mtq, "fp8", "fp8")
    assert base == mtq.FP8_DEFAULT_CFG and base is not mtq.FP8_DEFAULT_CFG
    rules = with_kv["quant_cfg"]
    text = json.dumps(rules, default=str)
    assert "bmm_quantizer" in text and "bmm_quantizer" not in json.dumps(base, default=str)
    with pytest.raises(ValueError, match="qformat"):
        qc.quant_config(mtq, "int3")


def _check_fp8_export(model_dir, out):
    from safetensors.torch import load_file

    meta = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
    assert meta["quant_algo"] == "FP8" and "lm_head" in meta["exclude_modules"]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    orig, quant = load_file(os.path.join(model_dir, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    linear = [k for k in orig if k.endswith("proj.weight")]
    assert linear
    for k in linear:
        w8, scale = quant[k], quant[k.replace(".weight", ".weight_scale")]
        assert w8.dtype == torch.float8_e4m3fn
        # per-tensor scale = amax / 448; E4M3 keeps 3 mantissa bits -> <= 1/16 relative error
        assert float(scale) == pytest.approx(float(orig[k].abs().max()) / 448.0, rel=1e-5)
        err = (w8.float() * scale - orig[k]).abs().max()
        assert float(err) <= orig[k].abs().max() / 16 + 1e-12
        assert (k.replace(".weight", ".input_scale")) in quant
    assert quant["lm_head.weight"].dtype == torch.float32  # excluded, kept as is
    return meta


def test_fp8_export_on_cpu(tiny_model, tmp_path, capsys):
    pytest.importorskip("modelopt.torch.quantization")
    out = str(tmp_path / "fp8")
    assert qc.main(["--model", tiny_model, "--out", out, "--calib-size", "4", "--kv-cache", "fp8",
                    "--device", "cpu"]) == 0
    assert "--quantization modelopt_fp8" in capsys.readouterr().out
    meta = _check_fp8_export(tiny_model, out)
    assert meta["kv_cache_quant_algo"] == "FP8"
    info = json.load(open(os.path.join(out, "hapo_quantization.json")))
    assert info["calib_samples"] == 4 and info["qformat"] == "fp8"


@pytest.mark.gpu
def test_fp8_export_on_gpu(tiny_model, tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    out = str(tmp_path / "fp8_gpu")
    assert qc.main(["--model", tiny_model, "--out", out, "--calib-size", "8", "--device", "cuda",
                    "--dtype", "fp32"]) == 0
    _check_fp8_export(tiny_model, out)
