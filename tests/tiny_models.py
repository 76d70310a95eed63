"""Tiny random-initialised causal LMs and tokenizers, saved with save_pretrained and loaded back
through the same code path as real checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Qwen2.5-like template that takes `tools`: they are listed in the system turn, calls are asked for
# in the Hermes syntax (fusion.fuse.tool_calls), and tool results come back as user turns.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\nThe functions you may call:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "To call one, answer <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif not (loop.first and m['role'] == 'system') %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Llama 3.x-like template that takes `tools` and asks for calls as bare JSON with "parameters".
LLAMA3_TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nGiven the following functions, respond with "
    "a JSON for a function call in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is 12 + 35 ? the answer is 47 .",
    "def add ( a , b ) : return a + b",
    "hello world , fusion of small models decodes one sequence together",
    "0 1 2 3 4 5 6 7 8 9 + - * = ?",
] * 4


def make_tokenizer(path: Path, vocab_size: int = 300, corpus: list[str] | None = None, *, tools: str | None = None):
    """A byte-level BPE tokenizer with a chat template and <|im_end|> as EOS; `tools`: a template that
    takes tools, "hermes" (Qwen's way: the tool call tags as tokens of their own) or "llama3" (calls as
    bare JSON)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus or CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    if tools == "hermes":
        fast.add_tokens(["<tool_call>", "</tool_call>"])  # not special: they decode as text, as Qwen's do
        fast.chat_template = TOOLS_CHAT_TEMPLATE
    elif tools == "llama3":
        fast.chat_template = LLAMA3_TOOLS_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_model(path: Path, tokenizer, *, seed: int, extra_rows: int = 0, hidden: int = 32, layers: int = 2,
               positions: int = 512):
    """A tiny Llama with `len(tokenizer) + extra_rows` output rows (padded embeddings), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + extra_rows,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init, so experts disagree visibly
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
