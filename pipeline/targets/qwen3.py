"""The dense Qwen3 family (`model_type` qwen3): every layer attention, the text model's config at the top of
config.json, keys already the causal LM's; the cache rolls back by cropping its KV layers. The shipped tiny
target (`data/assets/tiny-target`) is one."""

from pipeline.targets.family import TargetFamily

QWEN3 = TargetFamily(
    name="qwen3",
    title="Qwen3 (dense attention)",
    model_types=("qwen3",),
    modeling_module="transformers.models.qwen3.modeling_qwen3",
    rollback="crop",
)
