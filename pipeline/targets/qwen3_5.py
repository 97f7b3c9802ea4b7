"""The Qwen3.5/3.6 hybrid family: Gated-DeltaNet linear-attention layers between gated-attention layers, behind
a VLM class (`Qwen3_5ForConditionalGeneration`, model_type qwen3_5; its text-only form qwen3_5_text).

Its config.json holds the text model's config under `text_config`; its checkpoint keys carry the VLM's prefixes
(`model.language_model.*`, `language_model.lm_head.*`) beside a vision tower (`model.visual.*`) and the
multi-token-prediction head (`mtp.*`), which dflash never loads. transformers' modeling module binds the
flash-linear-attention and causal-conv1d kernels (reported by `pipeline/kernels.py`); `pipeline/fast_forward.py`
rebinds the decoder layer, the Gated DeltaNet and the norms to fused kernels; the cache rolls back by restoring
the linear-attention states and replaying the kept tokens (`pipeline/target_cache.py`)."""

from pipeline.targets.family import TargetFamily

QWEN3_5 = TargetFamily(
    name="qwen3_5",
    title="Qwen3.5/3.6 hybrid (Gated DeltaNet + gated attention)",
    model_types=("qwen3_5", "qwen3_5_text"),
    text_section="text_config",
    text_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head.")),
    skip_prefixes=("model.visual.", "visual.", "mtp.", "model.mtp."),
    text_model_attr="language_model",
    linear_layer_type="linear_attention",
    modeling_module="transformers.models.qwen3_5.modeling_qwen3_5",
    fast_forward_classes=("Qwen3_5DecoderLayer", "Qwen3_5GatedDeltaNet", "Qwen3_5RMSNorm"),
    rollback="snapshot-replay",
    files=("pipeline/fast_forward.py", "pipeline/kernels.py"),
)
