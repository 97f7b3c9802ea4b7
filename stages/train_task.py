"""The Lightning module of stage two: one DFlash training/validation step on a batch read from the store.

Contract:
- Trainable state is the drafter alone; the target's embedding and lm_head (from the store's
  frozen_head.safetensors) are plain tensors moved to the device, never parameters or DDP buffers.
- A step: decode features on the device -> blocks/labels/weights (pipeline.masks) -> drafter forward with
  one attention mask per layer type (flex on CUDA, SDPA on CPU) -> chunked gamma-weighted CE over the
  frozen head (pipeline.loss), normalised by the weight sum over ALL ranks.
- Metrics: loss, per-slot accuracy and tau = 1 + sum_k prod_{i<=k} acc_i, for train and validation; the
  padding fraction of each training batch and its documents per row (train.packing, data/packing.py); the
  learning rate, the wall time (s since this process started) and tokens/s (all ranks, since the previous batch).
- A non-finite loss on any rank stops every rank at that step with a hint; the last checkpoint stays good.
- The learning rate follows `WarmupCosine` over the planned optimizer steps; when the plan changes (a resume
  on another number of ranks, a followed store that ended smaller than planned) the rest of the schedule is
  stretched over the new remaining steps, so the rate never jumps. The same plan on every rank.
- DFLASH_SAMPLE_LOG=1: every rank appends the sample ids of each batch it trains to
  RUN/logs/samples-rankN.jsonl (a debugging and test aid: which samples each rank consumed, in order).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist

from data.packing import padding_stats
from pipeline.config import Config
from pipeline.train_step import build_drafter, compute_dtype, step_loss
from pipeline.encoding import decode
from pipeline.errors import NonFiniteLoss
from pipeline.acceptance import acceptance_length, slot_accuracy, slot_counts
from pipeline.loss import normalised_loss


class WarmupCosine:
    """The learning-rate factor by optimizer step: linear warmup over warmup_ratio of `total`, then cosine to 0.

    `replan(step, remaining)` keeps the factor at `step` and stretches the rest of the curve over `remaining`
    steps (a "virtual" step runs at a new rate from there). A callable object, so LambdaLR checkpoints its
    state with the scheduler's. Without a replan the factors equal the plain formula over integer steps."""

    def __init__(self, total: int, warmup_ratio: float):
        self.total = max(1, int(total))
        self.warmup = max(1, int(self.total * warmup_ratio))
        self.s0, self.v0, self.rate = 0, 0.0, 1.0

    def virtual(self, step: int) -> float:
        return self.v0 + (step - self.s0) * self.rate

    def __call__(self, step: int) -> float:
        v = self.virtual(step)
        if v < self.warmup:
            return (v + 1) / self.warmup
        progress = min(1.0, (v - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def remaining(self, step: int) -> float:
        return max(0.0, self.total - self.virtual(step)) / self.rate

    def replan(self, step: int, remaining: int) -> None:
        v = self.virtual(step)
        self.s0, self.v0 = step, v
        self.rate = max(self.total - v, 1e-9) / remaining if remaining > 0 else 1.0


class DrafterTask(L.LightningModule):
    def __init__(self, cfg: Config, layer_ids: list[int], vocab_size: int, head_path: str, steps_per_epoch: int,
                 encoding: str, target_meta: Optional[dict] = None, store_path: str = ""):
        super().__init__()
        self.cfg, self.layer_ids, self.vocab_size = cfg, list(layer_ids), vocab_size
        self.head_path, self.encoding, self.steps_per_epoch = head_path, encoding, steps_per_epoch
        self.drafter = build_drafter(cfg, layer_ids, vocab_size)  # drafter.arch: dflash | dflash2
        self.arch = self.drafter.arch
        self.bs = cfg.drafter.block_size
        self._embed: Optional[torch.Tensor] = None
        self._head: Optional[torch.Tensor] = None
        self.train_sampler = None  # set by stages.train (data position for resume)
        self.on_train_finished = None  # set by stages.train: the final checkpoint (stages.progress.FinalCheckpoint)
        self.target_meta, self.store_path = dict(target_meta or {}), store_path
        self.planned_steps: Optional[int] = None  # set by stages.train (the LR schedule's length)
        self.lr_schedule: Optional[WarmupCosine] = None
        self._sample_log = None
        self._t_batch: Optional[float] = None  # when the previous training batch ended (tokens/s)

    # -- frozen head ------------------------------------------------------------------------------------
    def _load_head(self) -> None:
        from pipeline.provenance import load_frozen_head

        dtype = compute_dtype(self.device.type, str(self.trainer.precision) if self._trainer else "32-true")
        self._embed, self._head = load_frozen_head(self.head_path, self.device, dtype)  # checked by stages.train

    def compiles(self, device_type: str) -> bool:
        """Whether training compiles the drafter's layers on this device type (train.compile: on | auto = on CUDA)."""
        mode = self.cfg.train.compile
        return mode == "on" or (mode == "auto" and device_type == "cuda")

    def on_fit_start(self) -> None:
        t0 = time.time()
        self._load_head()
        self.fit_start_parts = [("frozen head to the device", time.time() - t0)]  # stages/progress.py's line
        t0 = time.time()
        if self.compiles(self.device.type):
            from pipeline.compile_setup import prepare_compile

            # a recompile storm fails loudly instead of silently running eager. The limit counts the layer's
            # legitimate variants: input requires_grad (first layer or not) x layer type x grad mode (training
            # or validation) x static then dynamic shapes = up to 16. A tiny CPU run with compile on (varying
            # lengths, one batch of 1, validation) already needs 8, dynamo's default.
            from data.sampler import shapes_vary
            from pipeline.masks import set_dynamic_shapes

            # batches of many shapes (packed rows, mixed lengths): dynamic from the first compile, so no new
            # size recompiles after step 1 (issue 46 item 2); one padded length keeps torch's static kernels
            dynamic = True if shapes_vary(self.train_sampler, 128 if self.device.type == "cuda" else 1) else None
            prepare_compile(limit=16, dynamic=dynamic)  # and Inductor workarounds (pipeline/compile_setup.py)
            set_dynamic_shapes(dynamic)
            self.drafter.compile_layers(dynamic=dynamic)  # regional compilation (see DFlashDrafter.compile_layers)
        self.fit_start_parts.append(("compile set-up", time.time() - t0))

    def on_train_start(self) -> None:  # after the checkpoint's states are restored
        self._fit_started = time.time()
        self._plan_lr()
        from stages.train_ckpt_io import AsyncCheckpointIO, checkpoint_specs

        io = getattr(self.trainer.strategy, "checkpoint_io", None)
        if self.device.type == "cuda" and self.trainer.is_global_zero and isinstance(io, AsyncCheckpointIO):
            fused = any(o.defaults.get("fused") for o in self.trainer.optimizers)
            io.reserve(checkpoint_specs(self, step_on_device=fused))  # pinned beside the first batch's compile

    def on_train_epoch_start(self) -> None:
        self._plan_lr()

    def remaining_steps(self) -> Optional[int]:
        """Optimizer steps left by the data plan (None without a sampler), capped by train.max_steps."""
        if self.train_sampler is None:
            return None
        from data.sampler import remaining_steps

        left = remaining_steps(self.train_sampler, self.trainer.max_epochs, self.trainer.accumulate_grad_batches)
        if self.trainer.max_steps is not None and self.trainer.max_steps >= 0:
            left = min(left, max(0, self.trainer.max_steps - self.global_step))
        return left

    def total_steps(self) -> int:
        """The step count the run is planned to end at (for progress and ETA)."""
        if self.lr_schedule is None:
            return int(self.trainer.estimated_stepping_batches)
        return int(round(self.global_step + self.lr_schedule.remaining(self.global_step)))

    def data_state(self) -> dict:
        """Where the data plan stands, for progress.json (a following run: how far behind extraction it is)."""
        s = self.train_sampler
        if s is None:
            return {}
        d = {"epoch": s.epoch, "global_batches_done": s.global_done(), "global_batches": s.global_batches(s.epoch),
             "batch_size": s.batch_size, "stream_epoch": s.epoch in s.stream_epochs}
        if hasattr(s.source, "stream"):  # a growing store (data/follow.py); its loader workers do the waiting
            s.source.refresh()
            d.update(readable_samples=len(s.source.stream), planned_samples=s.source.planned, store_final=s.source.final)
        return d

    def _plan_lr(self) -> None:
        """Stretch the rest of the LR schedule over the steps the data plan now leaves. Every rank computes the
        same plan without a collective (the sampler never counts on how far a growing store has got)."""
        left = self.remaining_steps()
        if left is None or self.lr_schedule is None:
            return
        step, sched = self.global_step, self.lr_schedule
        if abs(sched.remaining(step) - left) > 0.5:
            if self.trainer.is_global_zero:
                print(f"train: the learning-rate schedule now ends after {left} more steps (step {step + left}, "
                      f"planned {step + sched.remaining(step):.0f}): the data plan changed", file=sys.stderr, flush=True)
            sched.replan(step, left)

    def on_train_end(self) -> None:  # after every callback's on_train_end, before Lightning's teardown
        if self.on_train_finished is not None:
            self.on_train_finished(self.trainer, self)

    def on_validation_start(self) -> None:
        if self._embed is None or self._embed.device != self.device:
            self._load_head()

    # -- the step ---------------------------------------------------------------------------------------
    def _features(self, batch: dict) -> torch.Tensor:
        x = decode(batch, self.encoding, self._embed.dtype)  # [B, S, L, H]
        return x.flatten(2)  # [B, S, L*H]

    def _forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        tokens, anchors = batch["tokens"], batch["anchors"]
        kind = "flex" if self.device.type == "cuda" else "sdpa"
        loss_sum, correct, blocks, extra = step_loss(self.drafter, tokens, batch["loss_mask"], anchors,
                                                     batch["seq_lens"], self._features(batch), self._embed,
                                                     self._head, self.cfg, kind, doc_ids=batch.get("doc_ids"))
        hits, counts = slot_counts(correct, blocks.labels, self.bs)  # [bs-1] each: slots 1..bs-1
        stats = {"weight_sum": blocks.weights.reshape(-1).sum().float(), "counts": counts, "hits": hits, "extra": extra}
        return loss_sum, stats

    def _global_weight(self, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All-reduce [weight_sum, non-finite flag]; returns (global weight sum, world size)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        buf = torch.stack([weight_sum.detach().float(), (~torch.isfinite(loss_sum.detach())).float()])
        if world > 1:
            dist.all_reduce(buf)
        if buf[1] > 0:
            raise NonFiniteLoss(
                f"non-finite loss at step {self.global_step}; stopping. The last checkpoint is intact: lower "
                "train.lr or check the store with `dflash verify`, then rerun with --resume"
            )
        return buf[0].clamp(min=1e-6), world

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss_sum, stats = self._forward(batch)
        window = batch.get("window_weight")  # under gradient accumulation: the window's weight (the loader's)
        w_global, world = self._global_weight(loss_sum, stats["weight_sum"] if window is None else window)
        loss = normalised_loss(loss_sum, w_global, world)  # DDP's average of these = sum over ranks / W_global
        if window is not None:  # Lightning divides each micro-batch's loss by accumulate_grad_batches: undo it,
            loss = loss * self.trainer.accumulate_grad_batches  # so the window's gradient is sum / W_window
        acc = slot_accuracy(stats["hits"], stats["counts"])  # [bs-1]
        if self.train_sampler is not None:
            self.train_sampler.consumed = batch_idx + 1
        if os.environ.get("DFLASH_SAMPLE_LOG"):
            self._log_samples(batch, batch_idx)
        B, S = batch["tokens"].shape
        self.log_dict({"train/loss": loss_sum.detach() / stats["weight_sum"].clamp(min=1e-6),
                       "train/tau": acceptance_length(acc.detach().cpu()),
                       "train/acc_slot1": acc[0].detach()}, prog_bar=True, on_step=True, batch_size=B)
        self.log("train/tokens", float(batch["seq_lens"].sum()), on_step=True, reduce_fx="sum", batch_size=B)
        pad, per_row = padding_stats(batch)  # packing's effect: padded token slots and documents per row
        self.log_dict({"train/pad_frac": pad, "train/docs_per_row": per_row}, on_step=True, batch_size=B)
        self.log_dict({f"train/{k}": v for k, v in stats["extra"].items()}, on_step=True, batch_size=B)  # dflash2
        self.log_dict(self._clock(float(batch["seq_lens"].sum())), on_step=True, batch_size=B)
        return loss

    def _clock(self, tokens: float) -> dict:
        """train/lr (this step's), train/wall_s (since the process started) and train/tokens_per_s (every rank's
        tokens since the previous batch; from the fit's start for the first)."""
        from stages.train_startup import process_start_time

        now = time.time()
        if self._t_batch is None:
            self._started = process_start_time()
            self._t_batch = getattr(self, "_fit_started", self._started)
        rate = tokens * self.trainer.world_size / max(now - self._t_batch, 1e-6)
        self._t_batch = now
        lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self.trainer.optimizers else float("nan")
        return {"train/lr": float(lr), "train/wall_s": now - self._started, "train/tokens_per_s": rate}

    def _log_samples(self, batch: dict, batch_idx: int) -> None:
        if self._sample_log is None:
            path = os.path.join(self.cfg.train.run_dir, "logs", f"samples-rank{self.global_rank}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._sample_log = open(path, "a", buffering=1)
        self._sample_log.write(json.dumps({"step": self.global_step, "epoch": self.current_epoch, "batch": batch_idx,
                                           "ids": batch["sample_ids"], "t": round(time.time(), 3)}) + "\n")

    def on_validation_epoch_start(self) -> None:
        self._val = {"loss": 0.0, "w": 0.0, "hits": torch.zeros(self.bs - 1), "counts": torch.zeros(self.bs - 1)}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss_sum, stats = self._forward(batch)
        self._val["loss"] += float(loss_sum)
        self._val["w"] += float(stats["weight_sum"])
        self._val["hits"] += stats["hits"].cpu()
        self._val["counts"] += stats["counts"].cpu()

    def on_validation_epoch_end(self) -> None:
        v = self._val
        buf = torch.cat([torch.tensor([v["loss"], v["w"]]), v["hits"], v["counts"]]).to(self.device, torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(buf)
        buf = buf.cpu()
        loss, w, hits, counts = buf[0], buf[1], buf[2 : 1 + self.bs], buf[1 + self.bs :]  # slots 1..bs-1
        acc = slot_accuracy(hits, counts).float()
        metrics = {"val/loss": float(loss / max(float(w), 1e-6)), "val/tau": acceptance_length(acc)}
        metrics.update({f"val/acc_slot{k}": float(acc[k - 1]) for k in range(1, self.bs)})
        self.log_dict(metrics, prog_bar=False, sync_dist=False, rank_zero_only=True)
        self.last_val = {**metrics, "step": self.global_step}  # every rank (all-reduced): stages/best_checkpoint.py

    # -- optimiser ------------------------------------------------------------------------------------
    def configure_optimizers(self):
        t = self.cfg.train
        decay, no_decay = [], []
        for n, p in self.drafter.named_parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        # fused on CUDA (one kernel over all parameters; issue 31 item 3): the clipping Lightning would refuse
        # with it is done in configure_gradient_clipping; foreach on the CPU (its numbers as before)
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=t.lr, betas=tuple(t.betas), **({"fused": True} if fused else {"foreach": True}))
        # the planned steps come from the data plan (stages.train); Lightning's estimate would set the train
        # dataloader up here, before a resumed run's loader state is restored, and that state would be lost
        total = self.planned_steps if self.planned_steps is not None else self.trainer.estimated_stepping_batches
        self.lr_schedule = WarmupCosine(total, t.warmup_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """train.grad_clip: the global gradient norm of the optimizer's parameters, clipped as Lightning's precision
        plugin would (the same call), but here: that plugin refuses a fused optimizer under bf16-mixed (it takes
        fused for a gradient scaler's unscaling, which bf16 has none of). The Trainer gets no clip value."""
        if self.cfg.train.grad_clip:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)

    # -- checkpoint extras ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dflash"] = {"config": self.cfg.to_dict(), "layer_ids": self.layer_ids, "vocab_size": self.vocab_size,
                                "encoding": self.encoding, "target": self.target_meta, "store": self.store_path,
                                "arch": self.arch.to_dict(), "step": self.global_step,
                                "val": dict(getattr(self, "last_val", {}))}  # the latest validation and its step
