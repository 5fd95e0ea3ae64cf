"""Whole training steps replayed from one CUDA graph (``Trainer(cuda_graphs=True)``, ``mode train --cuda-graphs``).

Shape legend: b rows of this process, m = b / N rows of a micro-batch, S sequence.

On a GPU the MoE and MoD layers are host-bound at moderate sizes: the host takes longer to launch a step's
few thousand kernels than the device takes to run them (docs/results-gpu.md). Their routing has static
shapes and makes no host sync (dropless token choice, MoD top-C), so a whole step -- forward, aux losses,
backward, gradient clipping, AdamW, the bias-balancing update and the routing statistics -- can be captured
once with ``torch.cuda.graph`` and replayed as one launch per step. That is torch's whole-network capture
pattern (torch.cuda docs, "CUDA Graphs"), with AdamW built ``capturable=True`` (its step counters and the
learning rate live on the device, so the update reads nothing from the host).

What changes for a step (``GraphedTrainStep.step``):
    inputs    the batch is copied into fixed input buffers (from pinned memory, without blocking) and the
              learning rate is written into AdamW's lr tensor (``fill_``: a kernel argument, no copy)
    warm-up   the first ``warmup`` steps run eagerly on a side stream (lazy initialisation -- AdamW's state,
              cuBLAS workspaces, autograd's streams -- must happen outside the capture); they are real steps
    capture   the next step is captured (its Python runs once, its kernels are recorded, not run) and replayed;
              every later step is a replay
    outputs   the cross-entropy, the realized FLOPs and the gradient norm are the graph's output tensors,
              read by the trainer with the step's other scalars (its one host sync, as without graphs)
    routing   the step's statistics are added in place into sums at fixed addresses (``StepSums``), which
              the trainer folds into its accumulator when it reads or saves them (``drain``)

The optimizer's checkpoints stay the plain format: a float learning rate, ``capturable`` False and CPU step
counters on save; a load sets them back (so a run with graphs resumes a run without, and the other way).

``capture=False`` runs exactly the captured code, eagerly, every step (the same buffers, optimizer and
in-place sums): the CPU rehearsal that the tests run under ``HostSyncCounter`` (0 would-be host syncs in the
captured region), and a reference for a GPU run. Not supported (ValueError): a device mesh, activation
checkpointing (its recompute saves and restores RNG state on the host), and gradient accumulation's counting
pass (``mode.train.accumulate``: a "global"-scope balance loss with more than one micro-batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mode.measure.flops import train_flops_per_token
from mode.measure.stats import RoutingAccumulator
from mode.routing.bias_balance import update_expert_bias
from mode.train.optim import build_optimizer

GRAPH_WARMUP_STEPS = 3  # eager steps before the capture (torch's docs warm up with 3)


class StepSums(RoutingAccumulator):
    """Routing sums at fixed addresses: ``_acc`` adds into the tensor already there (in place), so a replayed
    graph adds every step's statistics to the same memory. Its layout -- keys and sizes -- is an eagerly filled
    accumulator's (``like``); a statistic outside it is an error, not a silent new tensor."""

    @classmethod
    def like(cls, acc: RoutingAccumulator, device: torch.device) -> StepSums:
        sums = cls()
        sums.sums = {k: torch.zeros(v.shape, dtype=torch.float64, device=device) for k, v in acc.sums.items()}
        sums.layer_kinds = acc.layer_kinds
        return sums

    def _acc(self, key: str, value: Tensor | float) -> None:
        cur = self.sums.get(key)
        if cur is None:
            raise RuntimeError(
                f"routing statistic {key!r} appeared after the warm-up: a captured step's statistics "
                f"must keep one layout (known: {len(self.sums)} sums)"
            )
        if not isinstance(value, Tensor):
            cur.add_(float(value))  # a kernel argument: no host data reaches the device
            return
        v = value.detach().reshape(-1)
        if v.numel() != cur.numel():
            raise RuntimeError(
                f"routing statistic {key!r}: {v.numel()} values, the warm-up had {cur.numel()}; a "
                "captured step needs static shapes"
            )
        cur.add_(v)

    def zero_(self) -> None:
        if self.sums:
            torch._foreach_zero_(list(self.sums.values()))


def _plain_state_dict(optimizer, state_dict: dict) -> dict:
    """``state_dict`` post-hook: the format a non-capturable AdamW saves (float lr, CPU float32 step counters,
    ``capturable`` False), so that any run can resume from it. The live state is not touched."""
    groups = [
        {**g, "lr": float(g["lr"]) if isinstance(g["lr"], Tensor) else g["lr"], "capturable": False}
        for g in state_dict["param_groups"]
    ]
    state = {
        k: ({**v, "step": v["step"].detach().to("cpu", torch.float32)} if isinstance(v.get("step"), Tensor) else v)
        for k, v in state_dict["state"].items()
    }
    return {**state_dict, "state": state, "param_groups": groups}


def _capturable_on_load(optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre-hook: load as capturable (AdamW then moves the step counters to the device)."""
    return {**state_dict, "param_groups": [{**g, "capturable": True} for g in state_dict["param_groups"]]}


class GraphedTrainStep:
    """A trainer's step as one captured CUDA graph (module doc). Built by ``Trainer(cuda_graphs=True)``, which
    calls ``step`` for every training step, ``drain`` before it reads or saves the routing statistics and
    ``reset`` after loading a checkpoint. It replaces the trainer's optimizer by a capturable AdamW."""

    def __init__(self, trainer, capture: bool = True, warmup: int = GRAPH_WARMUP_STEPS):
        from mode.train.runtime import OneProcess

        if capture and trainer.device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs CUDA: this run is on {trainer.device}, and CUDA graphs capture "
                "CUDA kernels (torch.cuda.graph); leave it off on this device"
            )
        if not isinstance(trainer.runtime, OneProcess):
            raise ValueError(
                f"cuda_graphs=True: one process only for now (this run's runtime is "
                f"{type(trainer.runtime).__name__}); collectives inside a captured step are not supported"
            )
        if trainer.cfg.activation_checkpointing:
            raise ValueError(
                "cuda_graphs=True with activation_checkpointing=True: not supported together (the "
                "recompute saves and restores RNG state on the host); choose one"
            )
        if trainer.accumulation.routers:
            raise ValueError(
                f"cuda_graphs=True with grad_accum={trainer.cfg.grad_accum} and a 'global' balance loss: "
                "its counting pass (mode.train.accumulate) is not capturable; use balance_scope "
                "'batch' or 'sequence', or grad_accum=1"
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup={warmup!r}: must be an int >= 1 (eager steps before the capture)")
        self.trainer, self.capture, self.warmup = trainer, capture, warmup
        self.device = trainer.device
        self.optimizer = build_optimizer(trainer.model, trainer.cfg, capturable=True)
        self.lr_t: Tensor = self.optimizer.param_groups[0]["lr"]
        self.optimizer.register_state_dict_post_hook(_plain_state_dict)
        self.optimizer.register_load_state_dict_pre_hook(_capturable_on_load)
        self.optimizer.register_load_state_dict_post_hook(self._lr_tensor_on_load)
        trainer.optimizer = self.optimizer
        self.x_bS: Tensor | None = None  # the graph's input buffers
        self.y_bS: Tensor | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the graph (after a checkpoint load replaced the optimizer's state tensors): warm up and
        capture again. Sums not yet drained are dropped (a load replaces the statistics too)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None
        self.sums: StepSums | None = None
        self.dirty = False  # the sums hold steps not yet drained
        self.eager_steps = 0
        self.captures = 0

    def _lr_tensor_on_load(self, optimizer) -> None:
        """``load_state_dict`` post-hook: the loaded groups' float lr back into the one lr tensor."""
        for g in optimizer.param_groups:
            if not isinstance(g["lr"], Tensor):
                self.lr_t.fill_(g["lr"])
                g["lr"] = self.lr_t

    # -- a step ----------------------------------------------------------------------------------------------
    def step(self, x_BS: Tensor, y_BS: Tensor, lr: float) -> tuple[Tensor, Tensor | float, Tensor]:
        """One training step on the global batch ``x_BS, y_BS`` (this process's rows: all of them) at learning
        rate ``lr``; returns (mean cross-entropy, realized training FLOPs, gradient norm before clipping), device
        tensors (the FLOPs a float for a model without experts)."""
        self._load_inputs(x_BS, y_BS)
        self.lr_t.fill_(lr)
        if self.eager_steps < self.warmup:
            self.eager_steps += 1
            if self.eager_steps < self.warmup:
                return self._eager(self.trainer.routing)
            layout = RoutingAccumulator()  # the last warm-up step also lays out the in-place sums
            out = self._eager(layout)
            self.trainer.routing.merge(layout)
            self.sums = StepSums.like(layout, self.device)
            return out
        self.dirty = True
        assert self.sums is not None, "the last warm-up step laid out the sums"
        if not self.capture:  # the rehearsal: the captured code, run eagerly
            out = self._body(self.sums)
            self.optimizer.zero_grad(set_to_none=True)
            return out
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.outputs is not None, "the captured step: set by _capture"
        self.graph.replay()
        return self.outputs

    def _load_inputs(self, x_BS: Tensor, y_BS: Tensor) -> None:
        if self.x_bS is None or self.x_bS.shape != x_BS.shape:
            if self.graph is not None:
                assert self.x_bS is not None, "a captured graph was recorded with the input buffers"
                raise ValueError(
                    f"batch shape {tuple(x_BS.shape)}: the captured step was recorded for {tuple(self.x_bS.shape)}"
                )
            self.x_bS = torch.empty(x_BS.shape, dtype=x_BS.dtype, device=self.device)
            self.y_bS = torch.empty(y_BS.shape, dtype=y_BS.dtype, device=self.device)
        cuda = self.device.type == "cuda" and x_BS.device.type == "cpu"
        assert self.x_bS is not None and self.y_bS is not None, "allocated above"
        for buf, t in ((self.x_bS, x_BS), (self.y_bS, y_BS)):
            buf.copy_(t.pin_memory() if cuda else t, non_blocking=cuda)  # the pinned copy lives until copied

    def _eager(self, sums: RoutingAccumulator) -> tuple:
        """A warm-up step: the step's code, eagerly (on a side stream on CUDA, as torch's capture recipe asks)."""
        if self.device.type != "cuda":
            out = self._body(sums)
            self.optimizer.zero_grad(set_to_none=True)
            return out
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self._body(sums)
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def _capture(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's cached blocks go back: the graph's pool holds a step's memory again
        graph = torch.cuda.CUDAGraph()
        assert self.sums is not None, "the last warm-up step laid out the sums"
        with torch.cuda.graph(graph):
            self.outputs = self._body(self.sums)
        self.graph = graph
        self.captures += 1

    def _body(self, sums: RoutingAccumulator) -> tuple[Tensor, Tensor | float, Tensor]:
        """The captured region: forward, aux losses and backward of each micro-batch, clipping, AdamW, the
        bias-balancing update, the routing statistics. No host sync, no host data, static shapes."""
        t = self.trainer
        n = t.cfg.grad_accum
        ce: Tensor | float = 0.0
        flops: Tensor | float = 0.0
        assert self.x_bS is not None and self.y_bS is not None, "the input buffers: allocated by _load_inputs"
        for x_mS, y_mS in zip(self.x_bS.chunk(n), self.y_bS.chunk(n)):
            with t._autocast():
                out = t.model(x_mS, y_mS)
            sums.add_lm(t.model_cfg, out.aux, tuple(x_mS.shape))
            ((out.loss + out.aux.total()) / n).backward()
            ce = ce + out.loss.detach()
            flops = flops + train_flops_per_token(t.model_cfg, aux=out.aux, read=False) * x_mS.numel()
        grad_norm = t.runtime.clip_grad_norm_(t.params, t.cfg.grad_clip)
        self.optimizer.step()
        update_expert_bias(t.model, t.bias_routers)
        return ce / n, flops, grad_norm

    # -- statistics --------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Fold the sums of the steps since the last drain into the trainer's accumulator, and zero them."""
        if self.sums is not None and self.dirty:
            self.trainer.routing.merge(self.sums)
            self.sums.zero_()
            self.dirty = False
