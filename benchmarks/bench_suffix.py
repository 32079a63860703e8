"""Suffix decoding's host time per row and step: what a step of ``SuffixDrafter`` costs on the CPU
beside the GPU's work, measured on real answers without a model.

The answers of a prompt file (json / jsonl rows with an instruction or prompt and an output or
answer: new_codealpaca.json, gsm8k_train.jsonl) are tokenized with the target's tokenizer and
replayed as generation would feed them: B requests at a time, each emitting 1-3 tokens a step (the
τ the Qwen and SmolLM2 runs measured), the cache taking them in (local and global trees) and
speculating the row's next k tokens. Two speculation rules run on the same cache state: this
implementation's, which stops once the match's one occurrence ends its sequence, and the rule as
SuffixDecoding states it (every longer match until one does not occur). The drafts must be equal;
their times are set side by side.

    python benchmarks/bench_suffix.py --data DATA/new_codealpaca.json [--target smollm2-135m] [--requests 256]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specheads.runtime.drafters.suffix import SuffixCache  # noqa: E402


def load_pairs(path: Path, tokenizer, limit: int):
    rows = json.loads(path.read_text()) if path.suffix == ".json" else \
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = []
    for i, r in enumerate(rows):
        prompt = r.get("instruction") or r.get("prompt") or r.get("question")
        answer = r.get("output") or r.get("answer") or r.get("response")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise SystemExit(f"{path}: row {i} has no instruction/prompt/question and output/answer/response text")
        pairs.append((tokenizer.encode(prompt + " " + (r.get("input") or "")), tokenizer.encode(answer)))
        if len(pairs) == limit:
            break
    return pairs


def run(pairs, batch: int, k: int, new_tokens: int, seed: int = 0) -> dict:
    cache, rng = SuffixCache(24, 10000), random.Random(seed)
    t = {"take_in": 0.0, "speculate": 0.0, "every_match": 0.0}
    steps = 0
    for i0 in range(0, len(pairs), batch):
        group = list(enumerate(pairs[i0:i0 + batch], i0))
        for req, (prompt, _) in group:
            cache.start_request(req, prompt)
        pos = {req: 0 for req, _ in group}
        while True:
            live = [(req, a) for req, (_, a) in group if pos[req] < min(new_tokens, len(a))]
            if not live:
                break
            for req, answer in live:
                n = rng.choice((1, 1, 2, 3))
                t0 = time.perf_counter()
                cache.add_active_response(req, answer[pos[req]:pos[req] + n])
                t1 = time.perf_counter()
                pattern = cache.tokens(req)[-24:]
                got = cache.speculate(req, pattern, k)
                t2 = time.perf_counter()
                want = cache.speculate(req, pattern, k, every_match=True)
                t3 = time.perf_counter()
                if (got.tokens, got.match_len) != (want.tokens, want.match_len):
                    raise SystemExit(f"request {req}: drafts differ from the stated rule: {got} vs {want}")
                t["take_in"] += t1 - t0
                t["speculate"] += t2 - t1
                t["every_match"] += t3 - t2
                pos[req] += n
                steps += 1
        for req, _ in group:
            cache.stop_request(req)
    return {"row_steps": steps, **{f"{name}_us": 1e6 * s / steps for name, s in t.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a prompt file with answers (json / jsonl)")
    ap.add_argument("--target", default="smollm2-135m", help="whose tokenizer (a recipe's target.source)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from specheads.target import load_tokenizer
    tok = load_tokenizer(args.target, require_chat_template=False)
    pairs = load_pairs(args.data, tok, args.requests)
    r = run(pairs, args.batch, args.k, args.new_tokens)
    per_row = r["take_in_us"] + r["speculate_us"]
    ref = r["take_in_us"] + r["every_match_us"]
    print(f"{len(pairs)} requests of {args.data.name}, batch {args.batch}, k {args.k}, {r['row_steps']} row-steps "
          f"(drafts equal to the stated rule's in every one)\n")
    print("| host time per row and step | µs |\n|---|---:|")
    print(f"| take in the emitted tokens (local + global tree) | {r['take_in_us']:.1f} |")
    print(f"| speculate (this implementation) | {r['speculate_us']:.1f} |")
    print(f"| speculate (every longer match, as stated) | {r['every_match_us']:.1f} |")
    print(f"| a row's step, this / as stated | {per_row:.1f} / {ref:.1f} ({ref / per_row:.2f}×) |")
    print(f"| a batch-{args.batch} step, this / as stated | {per_row * args.batch / 1e3:.2f} ms / "
          f"{ref * args.batch / 1e3:.2f} ms |")
    out = {"data": str(args.data), "target": args.target, "requests": len(pairs), "batch": args.batch, "k": args.k,
           **r}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
