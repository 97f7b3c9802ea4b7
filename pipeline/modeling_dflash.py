"""transformers wrapper of the dflash drafter (copied into every export as modeling_dflash.py; the math is in
drafter.py and masks.py, copied beside it; acceptance.py holds the verify rules spec_generate applies, the same
as dflash's online eval; target_cache.py rolls back the target's cache, hybrid ones included).

    model = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

Two calling conventions:
- z-lab's (the published DFlash drafters'), so code written for those runs on this export:
      hidden = model(position_ids=..., noise_embedding=..., target_hidden=..., past_key_values=cache, use_cache=True)
      output_ids = model.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[eos],
                                       temperature=0.0)   # also mask_token_id=, top_p=, top_k=, return_stats=
  `position_ids` [B, n+Q] are the positions of the n context features new since the last call (target_hidden
  [B, n, L*H], target hidden_states[k+1] of the target_layer_ids) followed by the Q block tokens (noise_embedding
  [B, Q, H]: the target's embedding of [last accepted token, MASK, ...]). With a cache the drafter keeps the
  projected context across calls; the caller crops the cache back to the context after each draft, as z-lab's
  loop does (`cache.crop(-Q)`). Returns the final-normed hidden [B, Q, H]; logits = target.lm_head(hidden).
- the original keyword form: model(noise_embedding, target_hidden, position_ids) with target_hidden the whole
  context and position_ids [B, S+Q] (positional calls in that order still work).
spec_generate decodes greedily (temperature 0: output equal to the target's greedy decoding, token for token)
or samples with the speculative-sampling acceptance rule (temperature > 0, top_p, top_k).
"""

from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

from .acceptance import accept_step, sampling_probs, target_token
from .drafter import DFlashDrafter, DrafterArch, RMSNorm, draft_hidden, draft_tokens
from .target_cache import RollbackCache


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.arch = DrafterArch.from_exported(config.to_dict())
        core = DFlashDrafter(self.arch)  # same modules, same names: layers, fc, hidden_norm, norm
        self.layers, self.fc, self.hidden_norm, self.norm = core.layers, core.fc, core.hidden_norm, core.norm
        self.gradient_checkpointing = False
        self.target_layer_ids = self.arch.target_layer_ids
        self.block_size = self.arch.block_size
        self.mask_token_id = self.arch.mask_token_id
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, self.arch.initializer_range)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    project_context = DFlashDrafter.project_context
    pick = DFlashDrafter.pick  # the serving decision: the argmax (DFlash 2's model binds its selector walk)
    draws_from_logits = DFlashDrafter.draws_from_logits
    drafter_forward = DFlashDrafter.forward  # (block_embeds, ctx, q_pos, ctx_pos, attend) -> [B, Q, H]

    def draft_hidden(self, noise_embedding, ctx, q_pos, ctx_pos):
        """Hidden [B, Q, H] of one block at q_pos [B, Q] after the projected context ctx [B, S, H] at ctx_pos
        (the context is contiguous up to the block: all of it lies before the anchor). drafter.py's
        `draft_hidden`, the drafting sequence training and dflash's eval run."""
        return draft_hidden(self, noise_embedding, ctx, q_pos, ctx_pos, dtype=noise_embedding.dtype,
                            forward=self.drafter_forward)

    def forward(self, position_ids=None, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache: bool = False, **kwargs):
        if torch.is_tensor(position_ids) and position_ids.is_floating_point():  # the original positional order:
            noise_embedding, target_hidden, position_ids = position_ids, attention_mask, noise_embedding
            attention_mask = None
        if attention_mask is not None:
            raise ValueError("DFlashDraftModel builds its own attention mask (context before the block, the block "
                             "bidirectional, sliding layers windowed): pass attention_mask=None")
        B, Q, _ = noise_embedding.shape
        n = target_hidden.shape[1]
        dev = noise_embedding.device
        if position_ids is None:
            position_ids = torch.arange(n + Q, device=dev).expand(B, n + Q)
        position_ids = position_ids.expand(B, -1)
        new_ctx = self.project_context(target_hidden.to(noise_embedding.dtype))
        new_pos = position_ids[:, -(n + Q):-Q] if n else position_ids[:, :0]
        q_pos = position_ids[:, -Q:]
        if past_key_values is None:
            return self.draft_hidden(noise_embedding, new_ctx, q_pos, new_pos)
        kept = past_key_values.get_seq_length()  # the caller's crops decide how much context remains
        old = getattr(past_key_values, "_dflash_context", None)
        if old is not None and old[0].shape[1] > kept:
            old = (old[0][:, :kept], old[1][:, :kept])
        ctx = new_ctx if old is None else torch.cat([old[0], new_ctx], dim=1)
        ctx_pos = new_pos if old is None else torch.cat([old[1], new_pos], dim=1)
        hidden = self.draft_hidden(noise_embedding, ctx, q_pos, ctx_pos)
        past_key_values._dflash_context = (ctx, ctx_pos)
        # the cache's own length bookkeeping, as z-lab's drafter keeps it: n context + Q block entries per layer
        # (tiny placeholders; the projected context above is what the layers attend to)
        stub = torch.zeros(B, 1, n + Q, 1, dtype=noise_embedding.dtype, device=dev)
        for i in range(self.arch.num_hidden_layers):
            past_key_values.update(stub, stub, i)
        return hidden

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, mask_token_id: Optional[int] = None,
                      max_new_tokens: int = 2048, stop_token_ids: Optional[list] = None, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, block_size: Optional[int] = None,
                      return_stats: bool = False, generator: Optional[torch.Generator] = None):
        """Speculative decoding of one prompt with `target` (z-lab's signature). Returns output_ids [1, prompt +
        new tokens] (up to and including the first stop token), or with return_stats a SimpleNamespace(output_ids,
        num_input_tokens, num_output_tokens, acceptance_lengths). Each step drafts and verifies with dflash's
        online eval's own rules (drafter.py `draft_tokens`, acceptance.py `target_token` / `accept_step`): the
        same tokens and acceptance lengths as `dflash eval --online` on the same prompt and features. Sampling
        draws from `generator` (None: torch's default one)."""
        self.eval()
        if mask_token_id is not None and int(mask_token_id) != self.mask_token_id:
            raise ValueError(f"mask_token_id {mask_token_id} differs from the one this drafter was trained with "
                             f"({self.mask_token_id})")
        bs = int(block_size or self.block_size)
        stops = set(int(t) for t in (stop_token_ids or []))
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings()
        head = embed if head is None else head.weight
        probs = None if temperature <= 0 else (lambda x: sampling_probs(x.float(), temperature, top_p, top_k))
        ids = input_ids.to(embed.device)
        P = ids.shape[1]
        cache = RollbackCache(target)
        try:
            out = cache.forward(ids, output_hidden_states=True)
            ctx = self.project_context(self._features(out.hidden_states).to(self.fc.weight.dtype))
            ctx_pos = torch.arange(P, device=ids.device)[None]
            new = [target_token(out.logits[0, -1].float(), probs, generator)]
            accepted = []
            while new[-1] not in stops and len(new) < max_new_tokens:
                start = P + len(new) - 1  # position of the last token; the target's cache holds start tokens
                block = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=ids.device)
                block[0, 0] = new[-1]
                q_pos = start + torch.arange(bs, device=ids.device)[None]
                hidden = draft_hidden(self, block, ctx, q_pos, ctx_pos, embed=embed, dtype=self.fc.weight.dtype,
                                      forward=self.drafter_forward)
                draft, q, _ = draft_tokens(self, hidden[0, 1:], head, new[-1], probs, generator)
                out = cache.forward(torch.tensor([[new[-1]] + draft], device=ids.device), output_hidden_states=True)
                # greedy: the longest prefix equal to the target's argmax, then its own token; sampling: the
                # rejection rule, lossless in distribution
                n, bonus = accept_step(draft, q, out.logits[0].float(), probs, generator)
                produced = []
                for t in draft[:n] + [bonus]:
                    produced.append(t)
                    if t in stops or len(new) + len(produced) >= max_new_tokens:
                        break
                feats = self._features(out.hidden_states)[:, : n + 1]
                ctx = torch.cat([ctx, self.project_context(feats.to(self.fc.weight.dtype))], dim=1)
                ctx_pos = torch.cat([ctx_pos, q_pos[:, : n + 1]], dim=1)
                cache.rollback(start + n + 1)
                new += produced
                accepted.append(len(produced))
        finally:
            cache.close()
        output_ids = torch.cat([ids, torch.tensor([new], device=ids.device)], dim=1)
        if not return_stats:
            return output_ids
        return SimpleNamespace(output_ids=output_ids, num_input_tokens=P, num_output_tokens=len(new),
                               acceptance_lengths=accepted)

    def _features(self, hidden_states):
        """[1, T, L*H]: the target's hidden_states[k + 1] (output of layer k) for k in target_layer_ids."""
        return torch.cat([hidden_states[k + 1] for k in self.target_layer_ids], dim=-1)
