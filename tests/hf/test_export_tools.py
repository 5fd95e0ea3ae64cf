"""The tools people use on an exported model, run for real: lm-evaluation-harness (its CLI, on a local task),
peft (LoRA trains and merges back) and transformers' ``Trainer`` (a step whose loss holds the routers' aux
losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")
pytest.importorskip("lm_eval", reason="the test extra installs lm-eval: pip install -e '.[test]'")
pytest.importorskip("peft", reason="the test extra installs peft: pip install -e '.[test]'")

from transformers import AutoModelForCausalLM

from benchmarks.hf.export_lm_eval import TASK  # the local lm-eval task the benchmark writes
from mode.hf.export import export_transformers
from tests.hf.export_cases import trained

DOCS = [
    {"context": "def f(x):\n    ", "continuation": "return x"},
    {"context": "import ", "continuation": "mode"},
    {"context": "self", "continuation": ".x = 1"},
]


def mode_loglikelihood(lm, context: str, continuation: str) -> float:
    from tests.hf.export_cases import mode_logits

    n = len(context) - len(context.rstrip())  # lm-eval moves the context's trailing whitespace to the continuation
    context, continuation = context[: len(context) - n], context[len(context) - n :] + continuation
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = torch.tensor([ctx + cont])
    logp = mode_logits(lm, ids)[0].log_softmax(-1)
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_lm_eval_loglikelihoods_equal_modes(tmp_path):
    """``lm_eval --model hf`` on a staged-MoDE export (mode's class, trust_remote_code) with a local task: each
    document's log-likelihood equals mode's own (causal routing, what sampling sees)."""
    lm, _ = trained("staged_aux_bce", tmp_path / "run")
    export_transformers(lm, tmp_path / "hf")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mode_local.yaml").write_text(TASK.format(name="mode_local", data=data))
    env = dict(
        os.environ,
        HF_HOME=str(tmp_path / "hf_home"),  # trust_remote_code copies modeling_mode.py under it
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets"),
    )
    args = ["--model", "hf", "--tasks", "mode_local", "--include_path", str(tmp_path / "tasks")]
    args += ["--model_args", f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32,prefix_token_id=10"]
    args += ["--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path", str(tmp_path / "out")]
    run = subprocess.run([sys.executable, "-m", "lm_eval", *args], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_mode_local_*.jsonl")
    got = {}
    for line in samples.read_text().splitlines():
        rec = json.loads(line)
        got[rec["doc_id"]] = float(rec["resps"][0][0][0])
    assert sorted(got) == [0, 1, 2]
    for i, doc in enumerate(DOCS):
        want = mode_loglikelihood(lm, doc["context"], doc["continuation"])
        assert abs(got[i] - want) <= 1e-4 * abs(want) + 1e-5, (i, got[i], want)


@pytest.mark.parametrize("name,targets", [("dense_swiglu", ["q_proj", "v_proj"]), ("staged_aux_bce", ["qkv"])])
def test_peft_lora_trains_and_merges_back(name, targets, tmp_path):
    from peft import LoraConfig, get_peft_model

    lm, _ = trained(name, tmp_path / "run")
    res = export_transformers(lm, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=res.layout == "mode")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and sum(p.numel() for p in trainable) < sum(p.numel() for p in model.parameters()) / 4
    ids = torch.tensor([list(b"def f(x):\n    return x + 1\n")])
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(3):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        merged_model = peft_model.merge_and_unload()
        merged = merged_model(input_ids=ids).logits
    assert (merged - adapted).abs().max() <= 1e-4 * adapted.abs().max()
    merged_model.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=res.layout == "mode").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, merged)


def test_trainer_step_includes_router_aux_losses(tmp_path):
    """transformers' ``Trainer`` runs a step on a MoDE export; with ``output_router_logits`` the loss it logs is
    the cross-entropy plus the routers' weighted aux losses (as transformers' MoE families do)."""
    from transformers import Trainer, TrainingArguments

    lm, _ = trained("staged_aux_bce", tmp_path / "run")
    export_transformers(lm, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    model.config.output_router_logits = True
    ids = torch.tensor([list(b"def f(x):\n    return x + 1\n")[:24], list(b"import mode\nself.x = 1 + 2\n")[:24]])
    model.train()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        ce = model(input_ids=ids, labels=ids, output_router_logits=False).loss
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    assert torch.allclose(out.loss, ce + out.aux_loss)
    rows = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    result = trainer.train()
    logged = next(r["loss"] for r in trainer.state.log_history if "loss" in r)
    assert abs(logged - float(out.loss)) <= 1e-3 * float(out.loss), (logged, float(out.loss))
    assert result.global_step == 1
