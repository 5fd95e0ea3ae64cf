"""Probe: does transformers' own expert parallelism (DistributedConfig(ep_size=...)) train on CPU/gloo,
and how many bytes does each rank send per training step?

Standalone; run with `python benchmarks/_probe_tf_ep.py` (spawns 4 gloo processes per variant).
Prints a per-rank byte table per variant and writes everything to /tmp/tf_ep_bytes.json.

Model: a small random Qwen3-MoE causal LM saved with `save_pretrained` to a temp folder, then loaded on every
rank with `Qwen3MoeForCausalLM.from_pretrained(tmp, distributed_config=DistributedConfig(...))`.
Batch: 4 sequences x 32 tokens, the same on every rank (TP needs it). One forward + backward is measured after
one unmeasured warm-up step.

Interception: a TorchDispatchMode that sees every `c10d.*` op (what the eager `torch.distributed.*` API calls)
and every `_c10d_functional.*` op (funcol / DTensor redistribute / all_to_all_single_autograd), forward and
backward. Like torch's CommDebugMode it returns NotImplemented for DTensor ops, so DTensor desugars into its
collectives first and the mode then sees them on plain tensors.

Bytes each rank SENDS (standard algorithms), W = size of the group the collective runs on:
  all-reduce of N bytes           : 2 (W-1)/W N      (ring)
  all-gather, output N bytes      : (W-1)/W N
  reduce-scatter, input N bytes   : (W-1)/W N
  all-to-all                       : bytes of the rows whose destination is another rank
  broadcast, N bytes               : N * (W-1) on the root, 0 elsewhere (flat)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 4
BATCH, SEQ = 4, 32
STEP_TIMEOUT_S = 240  # wall clock per variant (each collective also has the 60 s process-group timeout)
OUT_JSON = "/tmp/tf_ep_bytes.json"

# `from_pretrained(distributed_config=...)` sets a device_map, and transformers then insists on `accelerate`
# (integrations/accelerate.py: check_and_set_device_map). The project venv does not ship it; to keep the venv
# untouched it can live in a side folder:  pip install --no-deps --target /tmp/tf_ep_deps accelerate psutil
_DEPS = os.environ.get("TF_EP_DEPS", "/tmp/tf_ep_deps")
try:
    import accelerate  # noqa: F401
except ImportError:
    if os.path.isdir(_DEPS):
        sys.path.append(_DEPS)

CONFIG_KW = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=128,
)

# name -> (DistributedConfig kwargs, overrides of CONFIG_KW)
# With the brief's config (num_key_value_heads=2) TP over 4 ranks cannot split the KV heads (32 k_proj features
# -> 8 per rank = half a head), so the TP variants are also run with num_key_value_heads=4 ("_kv4"), which
# changes no collective's shape (they carry (tokens, hidden) activations, vocab logits and small routing data).
KV4 = dict(num_key_value_heads=4)
VARIANTS = {
    # the documented way: TP plan on attention/embeddings/lm_head + EP plan on the experts;
    # ep_implementation="auto" -> AllToAllEP while training (AllReduceEP under no_grad)
    "tp4_ep4_auto": (dict(tp_size=4, ep_size=4), {}),
    "tp4_ep4_auto_kv4": (dict(tp_size=4, ep_size=4), KV4),
    # masking + all-reduce (what the removed ep_router + moe_tp_experts plan did); needs ep_size == tp_size
    "tp4_ep4_all_reduce_kv4": (dict(tp_size=4, ep_size=4, ep_implementation="all_reduce"), KV4),
    # the deprecated flag: becomes ep_size=tp_size with tp_plan={} (experts-only plan)
    "legacy_enable_expert_parallel": (dict(tp_size=4, enable_expert_parallel=True), {}),
    # what the deprecation warning recommends instead: EP plan only, no TP rule
    "tp4_ep4_empty_tp_plan": (dict(tp_size=4, ep_size=4, tp_plan={}), {}),
    # EP over data-parallel ranks (tp_size=1, FSDP2 on the dense part, efsdp=1); same batch on every rank here
    "fsdp4_ep4": (dict(fsdp_size=4, ep_size=4), {}),
    # baseline without EP: moe_tp_experts (each rank holds a 1/4 slice of every expert)
    "tp4_only_kv4": (dict(tp_size=4), KV4),
}

_SKIP = {"wait_tensor", "_wrap_tensor_autograd"}


def _group_of(arg):
    """(rank in group, group size) for a ProcessGroup object or a functional-collective group name."""
    if isinstance(arg, str):
        pg = dist.distributed_c10d._resolve_process_group(arg)
    elif isinstance(arg, torch.ScriptObject):  # what c10d.* ops receive under a dispatch mode
        pg = dist.ProcessGroup.unbox(arg)
    else:
        pg = arg
    return pg.rank(), pg.size()


def _nbytes(t):
    return t.numel() * t.element_size()


class CollectiveRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "none"
        self.records = []
        self.unknown = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives on local tensors first
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            name = func._opname
            if name not in _SKIP:
                try:
                    self._record(ns, name, args)
                except Exception as e:  # never break the run because of the probe
                    self.unknown.add(f"{ns}.{name}: {e!r}")
        return func(*args, **kwargs)

    def _add(self, kind, op, shape, dtype, group_size, sent, extra=None):
        rec = dict(
            phase=self.phase,
            kind=kind,
            op=op,
            shape=list(shape),
            dtype=str(dtype).replace("torch.", ""),
            group_size=group_size,
            bytes_sent=int(sent),
        )
        if extra:
            rec.update(extra)
        self.records.append(rec)

    def _record(self, ns, name, args):
        op = f"{ns}.{name}"
        if ns == "_c10d_functional_autograd":
            # not seen in practice (dispatches to _c10d_functional.* below the Python key); flagged if it is
            self.unknown.add(op)
            return
        if ns == "_c10d_functional":
            if name == "all_reduce":
                t, _, g = args[:3]
                _, w = _group_of(g)
                self._add("all_reduce", op, t.shape, t.dtype, w, 2 * (w - 1) / w * _nbytes(t))
            elif name == "all_gather_into_tensor":
                t, w, g = args[:3]
                self._add("all_gather", op, (t.shape[0] * w, *t.shape[1:]), t.dtype, w, (w - 1) * _nbytes(t))
            elif name == "reduce_scatter_tensor":
                t, _, w, g = args[:4]
                self._add("reduce_scatter", op, t.shape, t.dtype, w, (w - 1) / w * _nbytes(t))
            elif name == "all_to_all_single":
                t, out_splits, in_splits, g = args[:4]
                r, w = _group_of(g)
                self._add_a2a(op, t, list(in_splits), list(out_splits), r, w)
            elif name == "broadcast":
                t, src, g = args[:3]
                r, w = _group_of(g)
                self._add("broadcast", op, t.shape, t.dtype, w, _nbytes(t) * (w - 1) if r == src else 0)
            elif name in ("all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
                self.unknown.add(op)
                self._add(name, op, [len(args[0])], args[0][0].dtype, -1, 0)
            else:
                self.unknown.add(op)
            return
        # c10d.* : the eager torch.distributed API
        if name == "allreduce_":
            tensors, pg = args[0], args[1]
            _, w = _group_of(pg)
            for t in tensors:
                self._add("all_reduce", op, t.shape, t.dtype, w, 2 * (w - 1) / w * _nbytes(t))
        elif name == "_allgather_base_":
            out, inp, pg = args[:3]
            _, w = _group_of(pg)
            self._add("all_gather", op, out.shape, out.dtype, w, (w - 1) / w * _nbytes(out))
        elif name == "allgather_":
            outs, ins, pg = args[:3]
            _, w = _group_of(pg)
            for t in ins:
                self._add("all_gather", op, (t.shape[0] * w, *t.shape[1:]), t.dtype, w, (w - 1) * _nbytes(t))
        elif name == "_reduce_scatter_base_":
            out, inp, pg = args[:3]
            _, w = _group_of(pg)
            self._add("reduce_scatter", op, inp.shape, inp.dtype, w, (w - 1) / w * _nbytes(inp))
        elif name == "alltoall_base_":
            out, inp, pg, out_splits, in_splits = args[:5]
            r, w = _group_of(pg)
            self._add_a2a(op, inp, list(in_splits), list(out_splits), r, w)
        elif name == "broadcast_":
            tensors, pg, root = args[0], args[1], args[2]
            r, w = _group_of(pg)
            for t in tensors:
                self._add("broadcast", op, t.shape, t.dtype, w, _nbytes(t) * (w - 1) if r == root else 0)
        elif name in ("barrier", "monitored_barrier_"):
            self._add("barrier", op, [], "none", -1, 0)
        else:
            self.unknown.add(op)

    def _add_a2a(self, op, t, in_splits, out_splits, r, w):
        rows = t.shape[0] if t.dim() else 0
        if not in_splits:
            in_splits = [rows // w] * w
        row_bytes = _nbytes(t) // rows if rows else 0
        sent_rows = sum(s for i, s in enumerate(in_splits) if i != r)
        self._add(
            "all_to_all",
            op,
            t.shape,
            t.dtype,
            w,
            sent_rows * row_bytes,
            extra=dict(in_splits=[int(s) for s in in_splits], out_splits=[int(s) for s in out_splits]),
        )


def _summarize(records):
    """(phase, kind, shape, dtype, group) -> calls, bytes; all_to_all rows are merged per (phase, op, row shape)."""
    table = defaultdict(lambda: dict(calls=0, bytes_sent=0))
    for r in records:
        shape = tuple(r["shape"])
        if r["kind"] == "all_to_all" and r["dtype"] != "int64":
            shape = ("var",) + shape[1:]
        key = (r["phase"], r["kind"], shape, r["dtype"], r["group_size"])
        table[key]["calls"] += 1
        table[key]["bytes_sent"] += r["bytes_sent"]
    out = []
    for (phase, kind, shape, dtype, g), v in table.items():
        out.append(dict(phase=phase, kind=kind, shape=list(shape), dtype=dtype, group_size=g, **v))
    return out


def _worker(rank, variant, dist_kwargs, model_dir, port, result_dir):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    result = dict(variant=variant, rank=rank, dist_kwargs={k: v for k, v in dist_kwargs.items()})
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        import transformers
        from transformers import Qwen3MoeForCausalLM
        from transformers.distributed import DistributedConfig

        transformers.logging.set_verbosity_error()
        cfg = DistributedConfig(**dist_kwargs)
        result["resolved_distributed_config"] = {k: v for k, v in cfg.to_dict().items() if k != "tp_plan" or v is not None}
        model = Qwen3MoeForCausalLM.from_pretrained(model_dir, distributed_config=cfg)
        model.train()
        result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        layer0 = model.model.layers[0]
        result["hooked_modules_layer0"] = sorted(
            n for n, m in layer0.named_modules() if getattr(m, "_is_hooked", False)
        )
        result["param_placements_layer0"] = {
            n: (str(p.placements) if hasattr(p, "placements") else "plain", list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape))
            for n, p in layer0.named_parameters()
        }
        result["ep_impl_class"] = None
        ref = torch.load(os.path.join(model_dir, "ref.pt"))
        ids = ref["input_ids"]

        def step():
            out = model(input_ids=ids, labels=ids)
            rec.phase = "bwd"
            out.loss.backward()
            return out.loss.detach()

        # warm-up (not measured)
        rec = CollectiveRecorder()
        with rec:
            rec.phase = "fwd"
            step()
        model.zero_grad(set_to_none=True)
        warm_records = rec.records

        rec = CollectiveRecorder()
        with rec:
            rec.phase = "fwd"
            t0 = time.perf_counter()
            loss = step()
            result["step_s"] = time.perf_counter() - t0
        result["records"] = rec.records
        result["unknown_ops"] = sorted(rec.unknown)
        result["warmup_same_count"] = len(warm_records) == len(rec.records)

        # inference forward (no grad): auto EP switches to AllReduceEP when the EP group shares the batch
        inf = CollectiveRecorder()
        with torch.no_grad(), inf:
            inf.phase = "infer_fwd"
            model(input_ids=ids)
        result["infer_records"] = inf.records

        # correctness vs the single-process reference (collectives here are not recorded)
        result["loss"] = float(loss)
        result["ref_loss"] = float(ref["loss"])
        max_rel = 0.0
        worst = None
        # FSDP2 "keep_full_weight" modules (lm_head) stay unsharded after backward; their gradients sit on the
        # sharded parameters, which reshard() puts back on the module
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        for n, p in model.named_parameters():
            if p.grad is None:
                g = None
            else:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            r = ref["grads"].get(n)
            if r is None or g is None:
                if (r is None) != (g is None):
                    worst = f"{n}: grad missing ({'ref' if r is None else 'dist'})"
                    max_rel = float("inf")
                continue
            rel = float((g - r).norm() / (r.norm() + 1e-12))
            if rel > max_rel:
                max_rel, worst = rel, n
        result["grad_max_rel_err"] = max_rel
        result["grad_worst_param"] = worst
        result["ok"] = True
        dist.barrier()
    except BaseException as e:  # noqa: BLE001
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(os.path.join(result_dir, f"{variant}.{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_reference(model_dir, overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**CONFIG_KW, **overrides})
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(model_dir)
    # reload, so the reference runs exactly what every rank loads
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir)
    model.train()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CONFIG_KW["vocab_size"], (BATCH, SEQ), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save(dict(input_ids=ids, loss=out.loss.detach(), grads=grads), os.path.join(model_dir, "ref.pt"))
    return dict(
        config={**CONFIG_KW, **overrides},
        experts_implementation=getattr(model.config, "_experts_implementation", None),
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        ref_loss=float(out.loss.detach()),
    )


def _run_variant(variant, dist_kwargs, model_dir, result_dir):
    port = _free_port()
    ctx = mp.start_processes(
        _worker, args=(variant, dist_kwargs, model_dir, port, result_dir), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.time() + STEP_TIMEOUT_S
    hung = False
    while True:
        try:
            if ctx.join(timeout=2):
                break
        except Exception as e:  # a rank exited non-zero
            print(f"  [{variant}] process error: {type(e).__name__}: {str(e)[:300]}", flush=True)
            break
        if time.time() > deadline:
            hung = True
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            break
    per_rank = []
    for r in range(WORLD):
        path = os.path.join(result_dir, f"{variant}.{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                per_rank.append(json.load(f))
        else:
            per_rank.append(dict(variant=variant, rank=r, ok=False, error="no result (hung or killed)"))
    return per_rank, hung


def _fmt_bytes(b):
    return f"{b:,.0f}"


def _print_variant(variant, per_rank):
    r0 = per_rank[0]
    print(f"\n=== {variant}: DistributedConfig({', '.join(f'{k}={v!r}' for k, v in r0['dist_kwargs'].items())})"
          + (f" | config overrides {VARIANTS[variant][1]}" if VARIANTS[variant][1] else ""))
    if not all(r.get("ok") for r in per_rank):
        for r in per_rank:
            if not r.get("ok"):
                print(f"  rank {r['rank']} FAILED: {r.get('error')}")
                tb = r.get("traceback")
                if tb:
                    print("    " + "\n    ".join(tb.strip().splitlines()[-8:]))
                break
        return
    print(
        f"  runs: yes | loss {r0['loss']:.6f} vs single-process {r0['ref_loss']:.6f} | "
        f"max grad rel err {max(r['grad_max_rel_err'] for r in per_rank):.2e} | "
        f"experts impl {r0['experts_implementation']} | unknown ops {r0['unknown_ops']}"
    )
    print(f"  {'phase':9s} {'collective':14s} {'W':>2s} {'shape':18s} {'dtype':8s} {'calls':>5s} {'bytes/rank (r0)':>16s}")
    for row in sorted(_summarize(r0["records"] + r0["infer_records"]), key=lambda x: (x["phase"], x["kind"], str(x["shape"]))):
        print(
            f"  {row['phase']:9s} {row['kind']:14s} {row['group_size']:>2d} {str(tuple(row['shape'])):18s} "
            f"{row['dtype']:8s} {row['calls']:>5d} {_fmt_bytes(row['bytes_sent']):>16s}"
        )
    for r in per_rank:
        tot = defaultdict(int)
        for rec in r["records"] + r["infer_records"]:
            tot[rec["phase"]] += rec["bytes_sent"]
        print(
            f"  rank {r['rank']}: fwd {_fmt_bytes(tot['fwd'])} B, bwd {_fmt_bytes(tot['bwd'])} B, "
            f"train step {_fmt_bytes(tot['fwd'] + tot['bwd'])} B, inference fwd {_fmt_bytes(tot['infer_fwd'])} B"
        )


def main():
    only = sys.argv[1:]  # optional variant names
    out = dict(
        torch=torch.__version__,
        batch=[BATCH, SEQ],
        world=WORLD,
        backend="gloo",
        byte_rules={
            "all_reduce": "2*(W-1)/W*nbytes (ring)",
            "all_gather": "(W-1)/W*output_nbytes",
            "reduce_scatter": "(W-1)/W*input_nbytes",
            "all_to_all": "bytes of rows sent to other ranks",
            "broadcast": "nbytes*(W-1) on root, 0 elsewhere",
        },
        variants={},
    )
    import transformers

    out["transformers"] = transformers.__version__
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    out["references"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        result_dir = os.path.join(tmp, "results")
        os.makedirs(result_dir)
        for variant, (kw, overrides) in VARIANTS.items():
            if only and variant not in only:
                continue
            tag = "_".join(f"{k}{v}" for k, v in sorted(overrides.items())) or "base"
            model_dir = os.path.join(tmp, f"model_{tag}")
            if tag not in out["references"]:
                out["references"][tag] = _build_reference(model_dir, overrides)
            t0 = time.time()
            per_rank, hung = _run_variant(variant, kw, model_dir, result_dir)
            entry = dict(
                dist_kwargs=kw,
                config_overrides=overrides,
                hung=hung,
                wall_s=time.time() - t0,
                ok=all(r.get("ok") for r in per_rank),
            )
            entry["ranks"] = []
            for r in per_rank:
                rr = {k: v for k, v in r.items() if k not in ("records", "infer_records")}
                if r.get("ok"):
                    rr["summary"] = _summarize(r["records"] + r["infer_records"])
                    rr["totals"] = {
                        ph: sum(x["bytes_sent"] for x in r["records"] + r["infer_records"] if x["phase"] == ph)
                        for ph in ("fwd", "bwd", "infer_fwd")
                    }
                    rr["records"] = r["records"]
                entry["ranks"].append(rr)
            out["variants"][variant] = entry
            _print_variant(variant, per_rank)
    with open(OUT_JSON, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {OUT_JSON}")


if __name__ == "__main__":
    main()
