"""transformers wrapper of the dflash DFlash 2 drafter (copied into every DFlash 2 export as modeling_dflash2.py;
the math is in drafter2.py, copied beside it with DFlash's modeling_dflash.py, drafter.py, masks.py and
target_cache.py).

    model = AutoModel.from_pretrained(dir, trust_remote_code=True)
    hidden = model(noise_embedding, target_hidden, position_ids)      # [B, Q, H], as DFlashDraftModel
    logits = hidden[:, 1:] @ lm_head.T                                   # the target's head
    draft = model.select(hidden[:, 1:], logits, anchor_ids)             # [B, Q-1]: the selector's greedy walk
    output_ids = model.spec_generate(target=target, input_ids=ids, ...)  # DFlashDraftModel's, drafting with the walk
"""

from transformers import PreTrainedModel

from .drafter2 import CandidateSelector, DFlash2Arch, DFlash2Drafter, GroupedDynamicConv, ZeroLinear
from .modeling_dflash import DFlashDraftModel


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.arch = DFlash2Arch.from_exported(config.to_dict())
        core = DFlash2Drafter(self.arch)  # same modules, same names as the checkpoint
        self.layers, self.fc, self.hidden_norm, self.norm = core.layers, core.fc, core.hidden_norm, core.norm
        self.candidate_selector = core.candidate_selector
        self.gradient_checkpointing = False
        self.target_layer_ids = self.arch.target_layer_ids
        self.block_size = self.arch.block_size
        self.mask_token_id = self.arch.mask_token_id
        self.post_init()

    def _init_weights(self, module):  # a fresh (not loaded) model starts as DFlash2Drafter does
        if isinstance(module, (GroupedDynamicConv, ZeroLinear)):
            module.reset_parameters()  # identity convolutions
        elif isinstance(module, CandidateSelector):
            for p in module.parameters():
                p.data.normal_(0.0, self.arch.initializer_range)
        else:
            super()._init_weights(module)

    select = DFlash2Drafter.select  # (hidden [N, P, H], logits [N, P, V], anchor_ids [N]) -> draft ids [N, P]
    pick = DFlash2Drafter.pick  # the serving decision spec_generate drafts with (drafter.py `draft_tokens`): the walk
    draws_from_logits = DFlash2Drafter.draws_from_logits  # False: sampling keeps the walk, q one-hot
