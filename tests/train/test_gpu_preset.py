"""``mode train --preset gpu`` (sized for one H100/H200) and the MFU against a measured matmul ceiling."""

from __future__ import annotations

import pytest
import torch
from test_train import corpus, model_cfg, train_cfg

from mode.measure.flops import train_flops_per_token
from mode.model import LM
from mode.parallel.command import GPU_PRESET_PARAMS, PRESETS, mfu_line
from mode.train.log_sinks import measure_matmul_flops


def test_the_gpu_preset_builds_on_meta_with_its_stated_size():
    preset = PRESETS["gpu"]
    cfg = preset.model
    with torch.device("meta"):  # 873M parameters: no memory, no time
        model = LM(cfg)
    assert model.num_params() == GPU_PRESET_PARAMS
    assert 500e6 < GPU_PRESET_PARAMS < 1e9  # hundreds of millions
    assert f"{GPU_PRESET_PARAMS / 1e6:.0f}M parameters" in preset.doc
    assert (cfg.d_model, cfg.n_layers, cfg.seq_len, preset.train.batch_size) == (1024, 16, 2048, 32)
    assert cfg.capacity_factor is None and cfg.top_k == 2  # dropless token choice: static shapes (CUDA graphs)
    # a step's work: ~1 GFLOP per token of training, 65,536 tokens per step
    tokens = preset.train.batch_size * cfg.seq_len
    assert 0.5e9 < train_flops_per_token(cfg) < 2e9 and tokens == 65536


def test_the_measured_ceiling_is_cuda_only():
    with pytest.raises(ValueError, match=r"device=cpu: the matmul ceiling is measured on a CUDA device only"):
        measure_matmul_flops(torch.device("cpu"))


def test_mfu_against_a_measured_peak_is_logged_and_stated(tmp_path):
    from mode.train import Trainer

    t = Trainer(model_cfg("moe", "staged"), train_cfg(steps=3, peak_tflops=1e-3), corpus(), tmp_path, progress=False)
    t.measured_peak_flops = 0.5e9  # what mode train measures on a GPU at start-up
    last = [r for r in t.run() if "loss" in r][-1]
    assert last["mfu_measured"] == pytest.approx(last["flops"] / last["wall"] / 0.5e9)
    assert last["mfu_measured"] == pytest.approx(2 * last["mfu"])
    line = mfu_line(last, t)
    assert line.startswith(
        f"MFU {last['mfu_measured']:.1%} of measured 0 TFLOP/s peak (bf16 matmul timed at "
        f"start-up) ({last['mfu']:.1%} of the nominal 0 TFLOP/s); "
    )
    t.measured_peak_flops, t.peak_flops = None, None
    assert mfu_line({"tok_s": 1.0}, t) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_measured_ceiling_on_a_gpu():
    rate = measure_matmul_flops(torch.device("cuda"), n=4096, repeats=5)
    assert 1e12 < rate < 5e15
