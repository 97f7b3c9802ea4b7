"""Issue 29 item 5: one acceptance rule and one tau (pipeline/acceptance.py, shipped with the export; the one
drafting sequence is tests/test_draft_hidden.py's).

(b) the greedy and rejection rules on hand-built cases; (c) acceptance lengths, histograms, slot counts and tau
on hand-built lengths, and equal to the computations they replaced; (d) the rules' bodies exist once in the
tree, and the export ships them so that an exported directory runs spec_generate without dflash."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.acceptance import (AcceptanceStats, acceptance_length, acceptance_lengths, checkpoint_val_tau,
                                 greedy_accept, histogram, mean_length, sampling_probs, slot_accuracy, slot_counts,
                                 verify)
from pipeline.masks import IGNORE_INDEX

from helpers_drafters import tiny_drafter

ROOT = Path(__file__).resolve().parent.parent
H, BS, V = 16, 4, 40
LAYERS = [1, 3, 5]

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(0, target_layer_ids=LAYERS, sliding_window=6, block_size=BS, mask_token_id=3).eval()


# ---------------------------------------------------------------------------------------------------------------
# (b) the rules of one verify step, on hand-built cases
# ---------------------------------------------------------------------------------------------------------------


def _logits_for(ids: list[int]) -> torch.Tensor:
    """Target logits [len(ids), V] whose argmax row by row is ids."""
    return F.one_hot(torch.tensor(ids), V).float() * 5.0


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    target = _logits_for([5, 7, 9, 2])  # the target's choice after last, x1, x2, x3
    assert greedy_accept([5, 7, 1], target) == (2, 9)  # x3 differs: two accepted, the target's 9 next
    assert greedy_accept([6, 7, 9], target) == (0, 5)  # all rejected: the target's own first token
    assert greedy_accept([5, 7, 9], target) == (3, 2)  # all accepted + the bonus
    assert greedy_accept([], target[:1]) == (0, 5)


def _one_hot_p(ids: list[int]) -> torch.Tensor:
    return F.one_hot(torch.tensor(ids), V).float()


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-q", "given-q"])
def test_rejection_rule_on_hand_built_distributions(with_q):
    """With p and q one-hot the rule is deterministic: p_i(x_i) = 1 always accepts (u < 1), p_i(x_i) = 0 always
    rejects, and the residual max(0, p_i - q_i) is then p_i itself."""
    g = torch.Generator().manual_seed(0)
    draft = [5, 7, 9]
    q = _one_hot_p(draft) if with_q else None
    assert verify(draft, q, _one_hot_p([5, 7, 9, 2]), g) == (3, 2)  # all accepted + the bonus from p_4
    assert verify(draft, q, _one_hot_p([6, 7, 9, 2]), g) == (0, 6)  # all rejected: residual of slot 1
    assert verify(draft, q, _one_hot_p([5, 7, 1, 2]), g) == (2, 1)  # the prefix, then slot 3's residual
    assert verify([], None, _one_hot_p([4]), g) == (0, 4)  # nothing drafted: a draw from p_1
    assert verify(draft, q, _one_hot_p([5, 7, 9, 2]), None) == (3, 2)  # torch's default generator


def test_rejection_rule_residual_excludes_the_rejected_token():
    """p_1 = (0.5 on 5, 0.5 on 6), q_1 = one-hot on 5: a rejection of 5 must emit 6 (the residual), never 5."""
    p = torch.zeros(2, V)
    p[0, 5] = p[0, 6] = 0.5
    p[1, 8] = 1.0
    g = torch.Generator().manual_seed(1)
    seen = {verify([5], None, p, g) for _ in range(200)}
    assert seen == {(1, 8), (0, 6)}


def test_sampling_probs_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.equal(sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    top2 = sampling_probs(logits, 0.5, top_k=2)
    assert torch.allclose(top2, torch.cat([torch.softmax(logits[:, :2] / 0.5, -1), torch.zeros(1, 2)], -1))
    assert sampling_probs(logits, 1.0, top_p=0.1, top_k=3).tolist() == [[1.0, 0.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------------------------------------------
# (c) counting acceptance
# ---------------------------------------------------------------------------------------------------------------


def test_acceptance_lengths_histogram_and_tau_on_hand_built_blocks():
    labels = torch.tensor([[1, 2, 3]] * 4)
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 3]])
    valid = torch.ones(4, 3, dtype=torch.bool)
    valid[3, 2] = False  # the sequence ends after slot 2
    lengths = acceptance_lengths(draft, labels, valid)
    assert lengths.tolist() == [4, 2, 1, 3]
    assert histogram(lengths, 4) == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert histogram([3, 3, 1], 4) == {"1": 1, "2": 0, "3": 2, "4": 0}
    assert histogram([], 3) == {"1": 0, "2": 0, "3": 0}
    assert mean_length([3, 3, 1]) == pytest.approx(7 / 3) and mean_length([]) == 0.0
    stats = AcceptanceStats(4)
    stats.add(draft, labels, valid)
    s = stats.summary()
    assert s["blocks"] == 4 and s["tau"] == 2.5 and s["acceptance_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert s["slot_labelled"] == [4, 4, 3] and s["slot_accuracy"] == [0.75, 0.75, 1.0]
    assert s["tau_from_slot_acc"] == pytest.approx(1 + 0.75 + 0.75 ** 2 + 0.75 ** 2)


def _old_acceptance_stats(bs, batches):
    """stages/eval.py's AcceptanceStats before pipeline/acceptance.py (numpy)."""
    hist, hits, counts = np.zeros(bs + 1, np.int64), np.zeros(bs, np.int64), np.zeros(bs, np.int64)
    for draft, labels, valid in batches:
        match = (draft == labels) & valid
        acc_len = 1 + torch.cumprod(match.long(), dim=1).sum(dim=1)
        hist += np.bincount(acc_len.numpy(), minlength=bs + 1)[: bs + 1]
        hits[1:] += match.sum(0).numpy()
        counts[1:] += valid.sum(0).numpy()
    n = int(hist.sum())
    acc = (hits[1:] / np.maximum(counts[1:], 1)).astype(float)
    return {"blocks": n, "tau": float((hist * np.arange(bs + 1)).sum() / max(n, 1)),
            "tau_from_slot_acc": acceptance_length(acc), "slot_accuracy": [round(float(a), 6) for a in acc],
            "slot_labelled": [int(c) for c in counts[1:]],
            "acceptance_histogram": {str(k): int(hist[k]) for k in range(1, bs + 1)}}


def test_acceptance_stats_equal_the_old_eval_computation():
    g = torch.Generator().manual_seed(7)
    bs = 6
    batches = [(torch.randint(0, 3, (n, bs - 1), generator=g), torch.randint(0, 3, (n, bs - 1), generator=g),
                torch.rand(n, bs - 1, generator=g) < 0.9) for n in (13, 1, 40)]
    stats = AcceptanceStats(bs)
    for b in batches:
        stats.add(*b)
    assert stats.summary() == _old_acceptance_stats(bs, batches)


def test_slot_counts_equal_the_old_training_counts():
    """stages/train_task.py counted per-slot hits with index_add_ over all bs slots and dropped slot 0."""
    g = torch.Generator().manual_seed(8)
    B, A = 3, 5
    labels = torch.randint(0, V, (B, A * BS), generator=g)
    labels[torch.rand(B, A * BS, generator=g) < 0.3] = IGNORE_INDEX
    labels.view(B, A, BS)[:, :, 0] = IGNORE_INDEX  # slot 0 (the anchor) is never labelled
    correct = (torch.rand(B * A * BS, generator=g) < 0.6) & (labels.reshape(-1) >= 0)
    flat = labels.reshape(-1)
    slot = torch.arange(BS).repeat(B * A)
    valid = flat >= 0
    counts = torch.zeros(BS).index_add_(0, slot[valid], torch.ones_like(slot[valid], dtype=torch.float32))
    hits = torch.zeros(BS).index_add_(0, slot[valid], correct[valid].float())
    new_hits, new_counts = slot_counts(correct, labels, BS)
    assert torch.equal(new_hits, hits[1:]) and torch.equal(new_counts, counts[1:])
    assert torch.equal(slot_accuracy(new_hits, new_counts), hits[1:] / counts[1:].clamp(min=1))


def test_a_checkpoints_val_tau_is_its_own_validations():
    assert checkpoint_val_tau({"val/tau": 3.25, "step": 40}, 40) == 3.25
    assert checkpoint_val_tau({"val/tau": 3.25, "step": 30}, 40) is None  # an older validation
    assert checkpoint_val_tau({}, 40) is None and checkpoint_val_tau(None, 40) is None
    assert checkpoint_val_tau({"val/loss": 1.0, "step": 40}, 40) is None


# ---------------------------------------------------------------------------------------------------------------
# (d) the rules exist once, and the export ships them
# ---------------------------------------------------------------------------------------------------------------


def _sources():
    for pkg in ("pipeline", "data", "stages", "bench", "scripts"):
        for f in sorted((ROOT / pkg).glob("*.py")):
            yield f.relative_to(ROOT).as_posix(), ast.parse(f.read_text(), filename=str(f))


def _calls(tree, name: str) -> int:
    """Calls of `name` as a function or method (torch.cumprod(...), x.clamp(...), bincount(...))."""
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and
               (getattr(n.func, "attr", None) == name or getattr(n.func, "id", None) == name))


def _residuals(tree) -> int:
    """max(0, a[i] - b[i]) written as (a[i] - b[i]).clamp(...) / .clamp_min(...): the rejection rule's residual."""
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in
               ("clamp", "clamp_min") and isinstance(n.func.value, ast.BinOp) and isinstance(n.func.value.op, ast.Sub)
               and isinstance(n.func.value.left, ast.Subscript) and isinstance(n.func.value.right, ast.Subscript))


def _prefix_loops(tree) -> int:
    """`while n < len(draft) and draft[n] == target[n]`: the greedy accepted prefix."""
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.While) and isinstance(n.test, ast.BoolOp) and
               any(isinstance(c, ast.Compare) and isinstance(c.left, ast.Subscript) and isinstance(c.ops[0], ast.Eq)
                   and isinstance(c.comparators[0], ast.Subscript) for c in n.test.values))


def test_the_rules_and_the_counts_are_written_once():
    where = {"residual": [], "prefix": [], "uniform draws": [], "cumprod": [], "bincount": []}
    for path, tree in _sources():
        fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        where["residual"] += [path] * _residuals(tree)
        where["prefix"] += [path] * _prefix_loops(tree)
        # a function that draws uniforms and samples tokens is a rejection sampler
        where["uniform draws"] += [f"{path}:{f.name}" for f in fns if _calls(f, "multinomial") + _calls(f, "draw")
                                   and any(isinstance(c, ast.Call) and ast.unparse(c.func) == "torch.rand"
                                           for c in ast.walk(f))]
        where["cumprod"] += [path] * _calls(tree, "cumprod")
        where["bincount"] += [path] * _calls(tree, "bincount")
    assert where == {"residual": ["pipeline/acceptance.py"], "prefix": ["pipeline/acceptance.py"],
                     "uniform draws": ["pipeline/acceptance.py:verify"],
                     "cumprod": ["pipeline/acceptance.py"] * 2,  # acceptance_lengths, acceptance_length
                     "bincount": ["pipeline/acceptance.py"] * 2}  # histogram, AcceptanceStats.add


def test_every_relative_import_of_the_shipped_files_is_shipped():
    from pipeline.export2 import FILES2
    from pipeline.export_dir import MODELING_FILES

    shipped = {*MODELING_FILES, *FILES2}
    assert "acceptance.py" in shipped
    for name in sorted(shipped):
        tree = ast.parse((ROOT / "pipeline" / name).read_text())
        for n in tree.body:  # what importing the file runs (drafter.py's compile_layers imports lazily, training only)
            if isinstance(n, ast.ImportFrom) and n.level:
                assert f"{n.module}.py" in shipped, f"{name} imports .{n.module}, which the export does not copy"
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                top = (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name).split(".")[0]
                assert top not in ("pipeline", "data", "stages", "bench"), f"{name} imports dflash's {top}"


_WITHOUT_DFLASH = r'''
import importlib.abc, json, sys
class NoDflash(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pipeline", "data", "stages", "bench"):
            raise ImportError(f"dflash is not installed here ({name})")
sys.meta_path.insert(0, NoDflash())
import torch
from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(3)
target = Qwen3ForCausalLM(Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      tie_word_embeddings=False, initializer_range=0.3)).eval()
hf = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
prompt = torch.tensor([[5, 9, 11, 7, 20, 31, 4, 8, 13]])
greedy = target.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0].tolist()
got = hf.spec_generate(target=target, input_ids=prompt, max_new_tokens=16, return_stats=True)
torch.manual_seed(0)
sampled = hf.spec_generate(target=target, input_ids=prompt, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9)
print(json.dumps({"lossless": got.output_ids[0].tolist() == greedy, "steps": got.acceptance_lengths,
                  "sampled": sampled.shape[1], "pipeline": "pipeline" in sys.modules,
                  "acceptance": type(hf).__module__.rsplit(".", 1)[0] + ".acceptance" in sys.modules}))
'''


def test_an_export_runs_spec_generate_without_dflash(drafter, tmp_path):
    """The exported directory loads through transformers and decodes (greedy: equal to the target's greedy
    decoding; sampled: the shipped rejection rule) with dflash's packages unimportable; its checksums list
    acceptance.py."""
    from pipeline.export import export_drafter

    out = export_drafter(drafter, drafter.arch, tmp_path / "x", vocab_size=V, num_target_layers=8, dtype="float32")
    listed = [line.split("  ", 1)[1] for line in (out / "checksums.sha256").read_text().splitlines()]
    assert "acceptance.py" in listed and (out / "acceptance.py").read_text() == (ROOT / "pipeline/acceptance.py").read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _WITHOUT_DFLASH, str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["lossless"] and sum(res["steps"]) + 1 == 16 and res["sampled"] == 9 + 10
    assert not res["pipeline"] and res["acceptance"]


def test_no_stray_copy_of_the_rules_in_the_modeling_file():
    """spec_generate calls the shipped rules, the online eval's own (tests/test_drafting_rule.py); its old private
    copies (_accept, _probs, _pick) are gone."""
    text = (ROOT / "pipeline/modeling_dflash.py").read_text()
    assert not re.search(r"def _(accept|probs|pick)\b", text)
    for rule in ("accept_step(", "target_token(", "draft_tokens(", "draft_hidden("):
        assert rule in text, rule
