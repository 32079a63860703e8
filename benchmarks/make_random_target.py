"""A randomly initialised target of a real model's shape, saved as a local Hugging Face directory.

    python benchmarks/make_random_target.py --shape llama-3.1-8b --out /tmp/llama8b_random --data /tmp/llama8b_data

No hub is reachable, so the weights are random (acceptance is meaningless) but every stage's
memory and throughput at that size are real. The tokenizer is a word-level one with the model's
full vocabulary (``w0`` … ``wN`` plus Llama-3's special tokens) and Llama-3.1's chat template, so
any id the model emits decodes and re-encodes to itself. ``--data`` also writes conversations
(OpenAI messages JSONL) and prompts made of those words.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# the same code path on a CPU in seconds: a smoke test of the multi-GPU script
SHAPES["tiny-llama"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-5, max_position_embeddings=16384,
                            rope_theta=500000.0, rope_scaling=SHAPES["llama-3.1-8b"]["rope_scaling"])
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size - len(SPECIAL))}
    words.update({s: vocab_size - len(SPECIAL) + j for j, s in enumerate(SPECIAL)})
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|end_of_text|>", unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_data(out: Path, vocab: int, conversations: int, prompts: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)

    def text(n):
        return " ".join(f"w{rng.randrange(1, vocab - 64)}" for _ in range(n))

    with open(out / "conversations.jsonl", "w") as f:
        for i in range(conversations):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": text(rng.randint(16, 96))},
                {"role": "assistant", "content": text(rng.randint(128, 400))}]}) + "\n")
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"id": f"p{i}", "prompt": text(rng.randint(16, 64)), "category": "random"}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[args.shape]
    tok = make_tokenizer(shape["vocab_size"])
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of 8B weights
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    if args.data:
        make_data(args.data, shape["vocab_size"], args.conversations, args.prompts)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {args.shape}: {n / 1e9:.2f} B parameters -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
