"""One drafting rule (issue 42 item 1): the export's `spec_generate`, loaded through transformers with
trust_remote_code as a user loads it, drafts and verifies exactly as `dflash eval --online` does, for DFlash
and DFlash 2: the same tokens and the same acceptance lengths, prompt by prompt, greedy and sampled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.export import export_drafter

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
PROMPTS, NEW = 3, 20
# bf16 on the CPU: eval hands the drafter the target's bf16 features (a no-op rounding for a bf16 target),
# spec_generate the target's own hidden states; with a bf16 target the two are the same tensors
SETS = ["target.cpu_dtype=bfloat16", f"eval.num_prompts={PROMPTS}", f"eval.max_new_tokens={NEW}", "eval.seed=7"]

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)


def _drafter(arch: str, cfg):
    torch.manual_seed(0)
    d = (DFlashDrafter(DrafterArch.from_config(cfg.drafter, [1, 3, 5])) if arch == "dflash" else
         DFlash2Drafter(DFlash2Arch.from_config(cfg.drafter, [1, 3, 5], 576)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every parameter matters: the selector's walk is not the argmax
        for p in d.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return d


def _prompts_and_stops(cfg, target):
    from pipeline.target import load_tokenizer
    from stages.eval_online import heldout_prompts, stop_token_ids

    tok = load_tokenizer(cfg.target.path)
    prompts = []
    for _sid, messages in heldout_prompts(cfg, PROMPTS):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=cfg.data.enable_thinking)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return prompts, sorted(stop_token_ids(tok, target))


@pytest.mark.parametrize("temperature", [0.0, 4.0])
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_spec_generate_of_the_export_drafts_as_the_online_eval(arch, temperature, tmp_path):
    from transformers import AutoModel

    from pipeline.target import load_target
    from stages.eval import run_eval
    from stages.sampling import Sampling

    cfg = load_config(TINY, SETS + [f"eval.temperature={temperature}"])
    export = export_drafter(_drafter(arch, cfg), None, tmp_path / "export", vocab_size=576, num_target_layers=8,
                            tie_word_embeddings=True, dtype="bfloat16")
    out = tmp_path / "eval"
    assert run_eval(str(export), overrides=SETS + [f"eval.temperature={temperature}"], store=str(tmp_path / "none"),
                    online=True, out=str(out), device="cpu") == 0
    per_prompt = json.loads((out / "report.json").read_text())["online"]["per_prompt"]

    hf = AutoModel.from_pretrained(str(export), trust_remote_code=True, dtype=torch.bfloat16).eval()
    assert type(hf).__name__ == ("DFlashDraftModel" if arch == "dflash" else "DFlash2DraftModel")
    target = load_target(cfg.target.path, torch.bfloat16, torch.device("cpu"))
    prompts, stops = _prompts_and_stops(cfg, target)
    sampling = Sampling(temperature, cfg.eval.top_p, cfg.eval.seed)
    assert len(per_prompt) == len(prompts) == PROMPTS
    lengths = []
    for i, (ids, theirs) in enumerate(zip(prompts, per_prompt)):
        gen = None if sampling.greedy else sampling.generator(torch.device("cpu"), 2 * i + 1)  # eval's, per prompt
        got = hf.spec_generate(target=target, input_ids=torch.tensor([ids]), max_new_tokens=NEW,
                               stop_token_ids=stops, temperature=temperature, return_stats=True,
                               **({} if gen is None else {"generator": gen}))
        assert theirs["prompt_tokens"] == len(ids)
        assert got.output_ids[0, len(ids):].tolist() == theirs["tokens"], f"prompt {i}: other tokens"
        assert got.acceptance_lengths == theirs["acceptance_lengths"], f"prompt {i}: other acceptance lengths"
        lengths += got.acceptance_lengths
    if temperature > 0 and arch == "dflash":  # drafts from flat q and p are accepted at times: verify ran
        assert max(lengths) > 1


def test_the_dflash2_export_drafts_with_its_selector_walk_greedy_and_sampled(tmp_path):
    """The export's drafting decision is the drafter's `pick`: DFlash 2's walk, not the argmax, and sampling keeps
    the walk (q None: one-hot for the rejection rule), as the online eval drafts."""
    from transformers import AutoModel

    from pipeline.acceptance import sampling_probs
    from pipeline.drafter import draft_tokens

    cfg = load_config(TINY)
    export = export_drafter(_drafter("dflash2", cfg), None, tmp_path / "export", vocab_size=576, num_target_layers=8,
                            tie_word_embeddings=True, dtype="float32")
    hf = AutoModel.from_pretrained(str(export), trust_remote_code=True, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(7, 128, generator=g), torch.randn(576, 128, generator=g)
    with torch.no_grad():
        walk = hf.select(hidden[None], (hidden @ head.t())[None], torch.tensor([5]))[0].tolist()
        greedy, q, _ = draft_tokens(hf, hidden, head, 5)
        sampled, q_s, _ = draft_tokens(hf, hidden, head, 5, lambda x: sampling_probs(x, 1.0), g)
    assert greedy == walk == sampled and q is None and q_s is None
    assert walk != (hidden @ head.t()).argmax(-1).tolist()  # the walk is not the argmax here
