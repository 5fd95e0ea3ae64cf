"""lm-evaluation-harness on a model trained with ``mode train``, exported with ``mode export --format transformers``:
its log-likelihoods against mode's own, on held-out text.

    mode train --preset small --out runs/small
    python benchmarks/hf/export_lm_eval.py runs/small/ckpt.pt --out benchmarks/results/export_lm_eval.json

The task is a local lm-eval task (a YAML and a JSONL file written into a temporary folder: no hub is reachable):
``--docs`` windows of the checkpoint's validation text (the built-in corpus's held-out files, or the text or
token shards it trained on), each a ``--context``-token context and a ``--continuation``-token continuation.
``lm_eval --model hf`` scores every continuation; mode scores the same ids with its own forward (MoD layers
routing causally, as the export does). The script prints both per document and the largest difference, and
writes the JSON. lm-eval moves a context's trailing whitespace into the continuation: the windows are cut where
the context does not end in whitespace, so that both score the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_json
from mode.hf.export import export_transformers
from mode.model.generate import causal_problem
from mode.train import load_model
from mode.train.data import split_parts, text_codec
from mode.train.sources import load_corpus

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def windows(ckpt: str, n: int, ctx: int, cont: int) -> tuple[list[dict], list[list[int]]]:
    """``n`` (context, continuation) texts from the checkpoint's validation split, and their ids."""
    model, state = load_model(ckpt)
    codec = text_codec(state.get("data"), ckpt)
    record = state.get("data") or {}
    source = None if record.get("kind", "bytes") == "bytes" and record.get("path") is None else record.get("path")
    corpus = load_corpus(source, model.cfg.seq_len, None)
    val = split_parts(corpus.val)[0]  # the first file (or shard) of the held-out split
    ids_all = [int(i) for i in val[: n * (ctx + cont) * 4]]
    docs, ids = [], []
    start = 0
    while len(docs) < n and start + ctx + cont <= len(ids_all):
        c, k = ids_all[start : start + ctx], ids_all[start + ctx : start + ctx + cont]
        context, continuation = codec.decode(c), codec.decode(k)
        if context == context.rstrip() and codec.encode(context + continuation) == c + k:
            docs.append({"context": context, "continuation": continuation})
            ids.append(c + k)
        start += ctx + cont
    return docs, ids


@torch.no_grad()
def mode_scores(ckpt: str, ids: list[list[int]], ctx_lens: list[int]) -> list[float]:
    model, _ = load_model(ckpt)
    model.eval()
    causal = model.cfg.uses_mod and causal_problem(model.cfg) is None
    out = []
    for seq, c in zip(ids, ctx_lens):
        logp = model(torch.tensor([seq]), causal_routing=causal).logits_BSV[0].float().log_softmax(-1)
        out.append(float(sum(logp[c - 1 + i, t] for i, t in enumerate(seq[c:]))))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint of mode train (a file or a sharded folder)")
    p.add_argument("--out", default="benchmarks/results/export_lm_eval.json", help="the JSON to write")
    p.add_argument("--docs", type=int, default=64, help="documents of the local task (default 64)")
    p.add_argument("--context", type=int, default=192, help="context tokens per document (default 192)")
    p.add_argument("--continuation", type=int, default=64, help="continuation tokens per document (default 64)")
    args = p.parse_args()
    docs, ids = windows(args.checkpoint, args.docs, args.context, args.continuation)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        res = export_transformers(args.checkpoint, tmp / "hf")
        (tmp / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "mode_heldout.yaml").write_text(TASK.format(name="mode_heldout", data=tmp / "data.jsonl"))
        model_args = f"pretrained={tmp / 'hf'},trust_remote_code=True,dtype=float32,prefix_token_id=10"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args]
        cmd += ["--tasks", "mode_heldout", "--include_path", str(tmp / "tasks"), "--device", "cpu"]
        cmd += ["--batch_size", "1", "--log_samples", "--output_path", str(tmp / "out")]
        env = dict(os.environ, HF_HOME=str(tmp / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        env["HF_DATASETS_CACHE"] = str(tmp / "datasets")
        t0 = time.monotonic()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lm_eval_s = time.monotonic() - t0
        if run.returncode != 0:
            raise SystemExit(run.stderr[-4000:])
        (samples,) = (tmp / "out").rglob("samples_mode_heldout_*.jsonl")
        got = {}
        for line in samples.read_text().splitlines():
            rec = json.loads(line)
            got[rec["doc_id"]] = float(rec["resps"][0][0][0])
    ctx_lens = [len(s) - args.continuation for s in ids]
    want = mode_scores(args.checkpoint, ids, ctx_lens)
    rows = [{"doc": i, "lm_eval": got[i], "mode": w, "diff": got[i] - w} for i, w in enumerate(want)]
    worst = max(abs(r["diff"]) for r in rows)
    for r in rows[:8]:
        print(f"doc {r['doc']:3d}  lm-eval {r['lm_eval']:10.4f}  mode {r['mode']:10.4f}  diff {r['diff']:+.2e}")
    tokens = sum(len(s) - c for s, c in zip(ids, ctx_lens))
    nats = -sum(want) / tokens
    print(
        f"{len(rows)} documents, {tokens} continuation tokens: mode {nats:.4f} nats/token; "
        f"largest |lm-eval - mode| {worst:.2e} nats (layout {res.layout}, lm-eval {lm_eval_s:.0f} s)"
    )
    write_json(
        args.out,
        {
            "command": "python benchmarks/hf/export_lm_eval.py " + " ".join(sys.argv[1:]),
            "checkpoint": args.checkpoint,
            "layout": res.layout,
            "architecture": res.architecture,
            "export_max_logit_diff": res.max_logit_diff,
            "docs": len(rows),
            "continuation_tokens": tokens,
            "mode_nats_per_token": nats,
            "max_abs_diff_nats": worst,
            "lm_eval_seconds": lm_eval_s,
            "rows": rows,
            "machine": machine_info(),
        },
    )


if __name__ == "__main__":
    main()
