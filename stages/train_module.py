"""The Lightning module of stage two: one DFlash training/validation step on a batch read from the store.

Contract:
- Trainable state is the drafter alone; the target's embedding and lm_head (from the store's
  frozen_head.safetensors) are plain tensors moved to the device, never parameters or DDP buffers.
- A step: decode features on the device -> blocks/labels/weights (pipeline.masks) -> drafter forward with
  one attention mask per layer type (flex on CUDA, SDPA on CPU) -> chunked gamma-weighted CE over the
  frozen head (pipeline.loss), normalised by the weight sum over ALL ranks.
- Metrics: loss, per-slot accuracy and tau = 1 + sum_k prod_{i<=k} acc_i, for train and validation.
- A non-finite loss on any rank stops every rank at that step with a hint; the last checkpoint stays good.
"""

from __future__ import annotations

import math
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist

from pipeline.config import Config
from pipeline.dflash2_train import build_drafter, drafter_loss
from pipeline.encoding import decode
from pipeline.loss import normalised_loss
from pipeline.masks import build_blocks, make_attend


class NonFiniteLoss(RuntimeError):
    pass


def tau_from_slot_acc(acc: torch.Tensor) -> float:
    """acc [bs-1] per-slot accuracy (slots 1..bs-1) -> expected acceptance length incl. the target's token."""
    return float(1.0 + torch.cumprod(acc.clamp(0, 1), 0).sum())


def compute_dtype(device_type: str, precision: str) -> torch.dtype:
    """dtype of the frozen embedding/head and of the decoded features: bf16 on GPU under bf16 precision;
    fp32 on CPU and under "32-true" (whose fp32 layers would refuse bf16 inputs: no autocast casts them)."""
    return torch.bfloat16 if device_type == "cuda" and precision.startswith("bf16") else torch.float32


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

    # -- frozen head ------------------------------------------------------------------------------------
    def _load_head(self) -> None:
        from safetensors.torch import load, load_file

        from pipeline.store import is_local, read_bytes

        if is_local(self.head_path):  # memory-mapped, straight to the device: 2 x 2.5 GB at the 27B shape
            t = load_file(self.head_path.removeprefix("file://"), device=str(self.device))
        else:
            t = load(read_bytes(self.head_path))
        embed = t["embed_tokens.weight"]
        head = t.get("lm_head.weight", embed)  # tied targets store the embedding once
        dtype = compute_dtype(self.device.type, str(self.trainer.precision) if self._trainer else "32-true")
        self._embed = embed.to(self.device, dtype)
        self._head = head.to(self.device, dtype) if head is not embed else self._embed

    def on_fit_start(self) -> None:
        self._load_head()
        mode = self.cfg.train.compile
        if mode == "on" or (mode == "auto" and self.device.type == "cuda"):
            from pipeline.masks import loud_recompiles

            # a recompile storm fails loudly instead of silently running eager. The limit counts the layer's
            # legitimate variants: input requires_grad (first layer or not) x layer type x grad mode (training
            # or validation) x static then dynamic shapes = up to 16. A tiny CPU run with compile on (varying
            # lengths, one batch of 1, validation) already needed 8, dynamo's default and the old limit.
            loud_recompiles(limit=16)
            self.drafter.compile_layers()  # regional compilation (see DFlashDrafter.compile_layers)

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
        cfg = self.cfg
        tokens, loss_mask, anchors = batch["tokens"], batch["loss_mask"], batch["anchors"]
        B, S = tokens.shape
        blocks = build_blocks(tokens, loss_mask, anchors, self.bs, cfg.drafter.mask_token_id, cfg.train.gamma)
        kind = "flex" if self.device.type == "cuda" else "sdpa"
        attend = make_attend(kind, anchors=anchors, block_size=self.bs, ctx_len=S, layer_types=self.arch.layer_types,
                             sliding_window=self.arch.sliding_window, seq_lens=batch["seq_lens"])
        feats = self._features(batch)
        block_embeds = torch.nn.functional.embedding(blocks.input_ids, self._embed)  # [B, Q, H]
        ctx_pos = torch.arange(S, device=tokens.device).expand(B, S)
        ctx = self.drafter.project_context(feats)  # [B, S, H]
        hidden = self.drafter(block_embeds, ctx, blocks.positions, ctx_pos, attend)  # [B, Q, H]
        labels, weights = blocks.labels.reshape(-1), blocks.weights.reshape(-1)
        loss_sum, correct, extra = drafter_loss(self.drafter, hidden, self._head, blocks, tokens, cfg.train)
        slot = torch.arange(self.bs, device=tokens.device).repeat(B * anchors.shape[1])
        valid = labels >= 0
        counts = torch.zeros(self.bs, device=tokens.device).index_add_(0, slot[valid], torch.ones_like(slot[valid], dtype=torch.float32))
        hits = torch.zeros(self.bs, device=tokens.device).index_add_(0, slot[valid], correct[valid].float())
        stats = {"weight_sum": weights.sum().float(), "counts": counts, "hits": hits, "extra": extra}
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
        acc = stats["hits"][1:] / stats["counts"][1:].clamp(min=1)
        if self.train_sampler is not None:
            self.train_sampler.consumed = batch_idx + 1
        B, S = batch["tokens"].shape
        self.log_dict({"train/loss": loss_sum.detach() / stats["weight_sum"].clamp(min=1e-6),
                       "train/tau": tau_from_slot_acc(acc.detach().cpu()),
                       "train/acc_slot1": acc[0].detach()}, prog_bar=True, on_step=True, batch_size=B)
        self.log("train/tokens", float(batch["seq_lens"].sum()), on_step=True, reduce_fx="sum", batch_size=B)
        self.log_dict({f"train/{k}": v for k, v in stats["extra"].items()}, on_step=True, batch_size=B)  # dflash2
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val = {"loss": 0.0, "w": 0.0, "hits": torch.zeros(self.bs), "counts": torch.zeros(self.bs)}

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
        loss, w, hits, counts = buf[0], buf[1], buf[2 : 2 + self.bs], buf[2 + self.bs :]
        acc = (hits[1:] / counts[1:].clamp(min=1)).float()
        metrics = {"val/loss": float(loss / max(float(w), 1e-6)), "val/tau": tau_from_slot_acc(acc)}
        metrics.update({f"val/acc_slot{k}": float(acc[k - 1]) for k in range(1, self.bs)})
        self.log_dict(metrics, prog_bar=False, sync_dist=False, rank_zero_only=True)
        self.last_val = metrics

    # -- optimiser ------------------------------------------------------------------------------------
    def configure_optimizers(self):
        t = self.cfg.train
        decay, no_decay = [], []
        for n, p in self.drafter.named_parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=t.lr, betas=tuple(t.betas), foreach=True)  # not fused: Lightning clips gradients before the step
        total = self.trainer.estimated_stepping_batches
        warmup = max(1, int(total * t.warmup_ratio))

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoint extras ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dflash"] = {"config": self.cfg.to_dict(), "layer_ids": self.layer_ids, "vocab_size": self.vocab_size,
                                "encoding": self.encoding, "target": self.target_meta, "store": self.store_path,
                                "arch": self.arch.to_dict()}
