"""Tiny tokenizers built in code for tests (no hub downloads).

Each tokenizer is a `tokenizers` WordLevel model whose pre-tokenizer splits text into words (`\\w+`),
single punctuation characters and single whitespace characters, so the token sequence of a text is
predictable by eye: "Hi, you!\\n" -> ["Hi", ",", " ", "you", "!", "\\n"]. The vocabulary is every
printable ASCII character, a small word list and the template's special tokens; unknown words become
"<unk>". The decoder concatenates tokens, so `decode(ids) == text` for in-vocabulary text.

- `qwen_style_tokenizer()`: `<|im_start|>role\\n...<|im_end|>\\n` turns with Qwen3-like thinking handling:
  the generation prompt gets an empty `<think>\\n\\n</think>\\n\\n` when `enable_thinking` is false, and an
  assistant turn after the last user turn is rendered with that (possibly empty) think block, while
  earlier assistant turns are rendered without it (so history differs from a generation prompt).
- `llama_style_tokenizer()`: Llama-3-like headers, a BOS token in the text and `<|eot_id|>` ends turns.
- `broken_template_tokenizer()`: a template that abbreviates earlier assistant turns, so their content
  cannot be located in the full render (ingest must fail loudly, not guess).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = (
    "Hello hello Hi hi there you are how fine thanks thank What is the capital of France Paris It "
    "a an and or to in on me tell joke why did chicken cross road get other side Sure here Good "
    "question answer one two three four five six seven eight nine ten plus equals Let think about "
    "this helpful assistant You system user assistant model yes no ok bye Bye more again please"
).split()

QWEN_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_query_index and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

LLAMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Abbreviates the content of earlier assistant turns (as Qwen3 strips their reasoning): neither the
# prefix property nor the verbatim content holds, so the assistant turns cannot be located.
BROKEN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and not loop.last -%}"
    "{{- '<|im_start|>assistant\\n' + message.content[:2] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_word_tokenizer(
    special_tokens: list[str], chat_template: str, *, bos: str | None = None, eos: str | None = None
) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer over printable characters + WORDS, with `special_tokens` as added specials."""
    vocab: dict[str, int] = {}
    for tok in ["<unk>", "<pad>", *special_tokens, *string.printable, *WORDS]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token=bos,
        eos_token=eos,
        chat_template=chat_template,
    )


def qwen_style_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return build_word_tokenizer(specials, QWEN_TEMPLATE, eos="<|im_end|>")


def llama_style_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return build_word_tokenizer(specials, LLAMA_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")


def broken_template_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|im_start|>", "<|im_end|>"]
    return build_word_tokenizer(specials, BROKEN_TEMPLATE, eos="<|im_end|>")
