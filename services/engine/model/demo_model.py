"""write_demo_model: a random-weight Llama model folder with a real tokenizer, offline.

The folder is a standard Hugging Face one (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a Llama-3-style chat template, generation_config.json), so
transformers loads it as well as our loader.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .demo_corpus import corpus

log = logging.getLogger(__name__)

BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT]  # ids 0..4
# Llama 3's pre-tokenizer split: contractions, words, 1-3 digit numbers, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; expected system, user, "
    "assistant or tool') }}"
    "{% endif %}"
    "{% if message['content'] is not string %}"
    "{{ raise_exception('message content must be a string') }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class DemoSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_pos: int
    corpus_lines: int
    weight_dtype: torch.dtype


SIZES = {
    # ~0.4M parameters, ~2 MB: for tests.
    "tiny": DemoSize(64, 2, 4, 2, 192, 1024, 4096, 3000, torch.float32),
    # tiny with 4 layers: for tests of per-layer behaviour (prefetch, purge order).
    "tiny-deep": DemoSize(64, 4, 4, 2, 192, 1024, 4096, 3000, torch.float32),
    # ~100M parameters (bf16, ~200 MB): for demos and benchmarks with 4k-token histories.
    "small": DemoSize(768, 12, 12, 4, 2048, 16384, 8192, 60000, torch.bfloat16),
}


def train_tokenizer(vocab_size: int, corpus_lines: int, seed: int = 0) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus, padded with reserved special tokens
    (as Llama 3 does) so the vocabulary is exactly ``vocab_size``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(corpus_lines, seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def _config(s: DemoSize) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.hidden // s.heads,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [1, 4],
        "torch_dtype": str(s.weight_dtype).removeprefix("torch."),
        "use_cache": True,
    }


def _weights(s: DemoSize, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd = s.hidden // s.heads
    q, kv = s.heads * hd, s.kv_heads * hd

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(s.weight_dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=s.weight_dtype)

    w = {
        "model.embed_tokens.weight": normal(s.vocab, s.hidden),
        "model.norm.weight": ones(s.hidden),
        "lm_head.weight": normal(s.vocab, s.hidden),
    }
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "input_layernorm.weight": ones(s.hidden),
                p + "post_attention_layernorm.weight": ones(s.hidden),
                p + "self_attn.q_proj.weight": normal(q, s.hidden),
                p + "self_attn.k_proj.weight": normal(kv, s.hidden),
                p + "self_attn.v_proj.weight": normal(kv, s.hidden),
                p + "self_attn.o_proj.weight": normal(s.hidden, q),
                p + "mlp.gate_proj.weight": normal(s.intermediate, s.hidden),
                p + "mlp.up_proj.weight": normal(s.intermediate, s.hidden),
                p + "mlp.down_proj.weight": normal(s.hidden, s.intermediate),
            }
        )
    return w


def _fine_tune(base: dict[str, torch.Tensor], s: DemoSize, seed: int, share: float
               ) -> dict[str, torch.Tensor]:
    """``base`` with a fraction ``1 - share`` of its bytes redrawn from ``seed``, as a
    fine-tune that froze the rest does: the first layers' projections (and the embedding,
    head and norms) stay the base's bytes, the later ones change. Whole tensors are kept
    or changed, the latest layers changed first, as long as the changed bytes stay within
    the fraction."""
    fresh = _weights(s, seed)
    total = sum(t.numel() * t.element_size() for t in base.values())
    out = dict(base)
    changed = 0
    names = sorted((n for n in base if n.startswith("model.layers.") and "norm" not in n),
                   key=lambda n: (-int(n.split(".")[2]), n))
    target = (1.0 - share) * total
    for name in [*names, "lm_head.weight", "model.embed_tokens.weight"]:
        nbytes = base[name].numel() * base[name].element_size()
        if changed and changed + nbytes > target:
            continue  # (would overshoot: a smaller tensor may still fit the fraction)
        out[name] = fresh[name]
        changed += nbytes
    return out


def write_demo_model(path: str | Path, size: str = "tiny", seed: int = 0,
                     base_seed: int | None = None, share: float = 0.0) -> Path:
    """Write the demo model folder at ``path`` (created if needed) and return it. With
    ``base_seed``: a fine-tune of the model ``base_seed`` gives, sharing a fraction
    ``share`` of its weight bytes with it (whole tensors; see ``_fine_tune``)."""
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tok = train_tokenizer(s.vocab, s.corpus_lines, seed if base_seed is None else base_seed)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "model_max_length": s.max_pos,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOT}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(_config(s), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4], "do_sample": False}, indent=2)
    )
    weights = _weights(s, seed if base_seed is None else base_seed)
    if base_seed is not None and share < 1.0:
        weights = _fine_tune(weights, s, seed, share)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    log.info("wrote %s demo model to %s in %.1fs", size, out, time.perf_counter() - start)
    return out
