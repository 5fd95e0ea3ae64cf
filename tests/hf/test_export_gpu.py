"""An exported model on CUDA (issue 65's GPU run): transformers' logits of a Mixtral-layout and a MoDE export equal
mode's on the GPU, in float32 and bfloat16, and greedy decoding of the MoDE export equals mode's there."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")

from transformers import AutoModelForCausalLM

from mode.hf.export import export_transformers
from mode.model.generate import generate
from tests.hf.export_cases import batch_ids, mode_logits, prompt_ids, trained


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["moe_renormalized", "mixed_pattern"])
def test_export_on_cuda_equals_mode(name, tmp_path):
    with torch.device("cpu"):
        lm, _ = trained(name, tmp_path / "run")
    res = export_transformers(lm, tmp_path / "hf")
    lm = lm.cuda()
    ids = batch_ids().cuda()
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", dtype=dtype, trust_remote_code=res.layout == "mode"
        ).cuda()
        model.eval()
        want = mode_logits(lm.to(dtype), ids)
        with torch.no_grad():
            got = model(ids).logits.float()
        assert (got - want).abs().max() <= rel * want.abs().max(), (dtype, float((got - want).abs().max()))
    if res.layout == "mode":  # mode's own class: the same ops, the same tokens
        lm = lm.float()
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, trust_remote_code=True)
        model = model.cuda().eval()
        prompt = prompt_ids()
        out = model.generate(torch.tensor([prompt]).cuda(), max_new_tokens=12, do_sample=False)
        assert out[0, len(prompt) :].tolist() == generate(lm, [prompt], 12, temperature=0)[0]
