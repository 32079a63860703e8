"""Turn-by-turn chat generation over many conversations.

Shared by ``specheads eval`` and ``specheads data regenerate``: each
conversation's user turns are answered in order, and the target's own
earlier answers are fed back (as a server would see them). Every request
gets its own seed derived from its id, so a conversation's output does not
depend on which batch it landed in — that is what makes regeneration
resumable and deterministic.

Two schedules: fixed batches (every turn of a batch waits for its longest
answer; eval measures drafting this way) and continuous batching
(``generate_flows``; ``chat_generate(continuous=True)`` without a drafter, or
``chat_continuous`` with or without one, as the eval's serving sweep runs): a
finished answer's slot takes the next prompt at once, and a conversation's next
turn is queued, whole conversation so far, ahead of the conversations not yet
started.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from .engines.continuous import Request, generate_flows
from .engines.static import generate
from .metrics import StepRecord


def seed_for(conv_id: str, seed: int, turn: int = 0) -> int:
    h = hashlib.sha256(f"{seed}:{conv_id}:{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


@dataclass
class ChatResult:
    id: str
    category: str | None
    messages: list[dict]                                   # the whole conversation, answers included
    prompt_tokens: list[list[int]] = field(default_factory=list)   # per turn: the rendered prompt ids
    answer_tokens: list[list[int]] = field(default_factory=list)   # per turn: generated ids
    finish_reasons: list[str] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    # per turn, continuous batching only: the target decode forwards of the turn's request (its τ is
    # (len(answer) - 1) / forwards: the first token is the prefill's)
    target_forwards: list[int] = field(default_factory=list)


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the template already holds any BOS it wants; servers tokenize it without adding more
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_generate(engine, tokenizer, conversations: list[dict], *, max_new_tokens: int, batch_size: int = 1,
                  drafter=None, k: int = 3, tree=None, rule: str = "greedy", temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, thresholds=(1.0, 1.0), seed: int = 0,
                  max_prompt_tokens: int | None = None, use_cuda_graphs: bool = False,
                  on_done=None, progress=None, continuous: bool = False,
                  sync_every: int = 8, refill_at: int = 1) -> tuple[list[ChatResult], float]:
    """Answer every user turn of every conversation; returns (results in input order, wall
    seconds in generation).

    ``conversations``: ``{"id", "turns": [str], "category", "system"?}``. ``on_done(result)``
    is called as each conversation completes (regeneration writes it out at once).
    Conversations whose rendered prompt exceeds ``max_prompt_tokens`` get ``finish_reasons
    == ["skipped:overlong"]`` and no answer. ``continuous``: continuous batching over
    ``batch_size`` slots, finished rows looked for every ``sync_every`` steps and free slots
    refilled once ``refill_at`` are free (``ContinuousGeneration``); it decodes
    plainly, so with a drafter the fixed batches run instead. Its results carry no per-step
    records (plain decoding emits one token per forward).
    """
    if continuous and drafter is None:
        results, stats = chat_continuous(engine, tokenizer, conversations, max_new_tokens=max_new_tokens,
                                         batch_size=batch_size, temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, max_prompt_tokens=max_prompt_tokens,
                                         use_cuda_graphs=use_cuda_graphs, on_done=on_done, progress=progress,
                                         sync_every=sync_every, refill_at=refill_at)
        return results, stats["seconds"]
    results: list[ChatResult] = []
    gen_seconds = 0.0
    for start in range(0, len(conversations), batch_size):
        batch = conversations[start:start + batch_size]
        states = []
        for c in batch:
            msgs = [{"role": "system", "content": c["system"]}] if c.get("system") else []
            states.append(ChatResult(id=str(c["id"]), category=c.get("category"), messages=msgs))
        n_turns = max(len(c["turns"]) for c in batch)
        for turn in range(n_turns):
            live = [i for i, c in enumerate(batch) if turn < len(c["turns"]) and not _skipped(states[i])]
            prompts = []
            for i in list(live):
                states[i].messages.append({"role": "user", "content": batch[i]["turns"][turn]})
                ids = render_prompt(tokenizer, states[i].messages)
                if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                    states[i].finish_reasons = ["skipped:overlong"]
                    live.remove(i)
                    continue
                states[i].prompt_tokens.append(ids)
                prompts.append(ids)
            if not live:
                continue
            t0 = time.perf_counter()
            res = generate(engine, prompts, max_new_tokens, drafter=drafter, k=k, tree=tree, rule=rule,
                           temperature=temperature, top_k=top_k, top_p=top_p, thresholds=thresholds,
                           seed=[seed_for(states[i].id, seed, turn) for i in live], use_cuda_graphs=use_cuda_graphs)
            gen_seconds += time.perf_counter() - t0
            for j, i in enumerate(live):
                toks = res.tokens[j]
                states[i].answer_tokens.append(toks)
                states[i].finish_reasons.append(res.finish_reasons[j])
                text = tokenizer.decode(_strip_stop(toks, engine.args.eos_token_ids), skip_special_tokens=True)
                states[i].messages.append({"role": "assistant", "content": text})
            for r in res.records:
                states[live[r.request]].records.append(r)
            if progress is not None:
                progress(sum(len(t) for t in res.tokens))
        for s in states:
            results.append(s)
            if on_done is not None:
                on_done(s)
    return results, gen_seconds


def _conversation(c: dict, state: ChatResult, tokenizer, eos, max_prompt_tokens, max_new_tokens, seed):
    """One conversation's turns: yields each turn's ``Request``, receives the answer's (tokens,
    finish reason). Returns early when a prompt is overlong."""
    for turn, text in enumerate(c["turns"]):
        state.messages.append({"role": "user", "content": text})
        ids = render_prompt(tokenizer, state.messages)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            state.finish_reasons = ["skipped:overlong"]
            return
        state.prompt_tokens.append(ids)
        req = Request(ids, max_new_tokens, seed=seed_for(state.id, seed, turn))
        toks, why = yield req
        state.answer_tokens.append(toks)
        state.finish_reasons.append(why)
        state.target_forwards.append(req.target_forwards)   # set by the engine before it hands the answer back
        text = tokenizer.decode(_strip_stop(toks, eos), skip_special_tokens=True)
        state.messages.append({"role": "assistant", "content": text})


def chat_continuous(engine, tokenizer, conversations: list[dict], *, max_new_tokens: int, batch_size: int,
                    drafter=None, k: int = 3, rule: str | None = None, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, max_prompt_tokens: int | None = None,
                    use_cuda_graphs: bool = False, on_done=None, progress=None, sync_every: int = 8,
                    refill_at: int = 1, pipeline_harvest: bool | None = None) -> tuple[list[ChatResult], dict]:
    """Every user turn of every conversation through ``batch_size`` slots with continuous batching, plain or
    with a chain ``drafter`` (``k`` drafts a step; ``rule`` as ``generate_continuous`` takes it), as a server
    serves them; returns (results in input order, ``generate_continuous``'s counts: ``tau``, ``tokens``,
    ``seconds``, ...). Each result's ``target_forwards`` holds its turns' decode forwards.
    ``pipeline_harvest``: None leaves ``generate_flows``' default (on, on a GPU: bulk generation)."""
    states = []
    for c in conversations:
        msgs = [{"role": "system", "content": c["system"]}] if c.get("system") else []
        states.append(ChatResult(id=str(c["id"]), category=c.get("category"), messages=msgs))
    eos = engine.args.eos_token_ids
    flows = ((i, _conversation(c, states[i], tokenizer, eos, max_prompt_tokens, max_new_tokens, seed))
             for i, c in enumerate(conversations))
    stats = generate_flows(engine, flows, lambda i: on_done(states[i]) if on_done is not None else None,
                           on_tokens=progress, batch_size=batch_size, temperature=temperature, top_k=top_k,
                           top_p=top_p, use_cuda_graphs=use_cuda_graphs, sync_every=sync_every,
                           refill_at=refill_at, drafter=drafter, k=k, rule=rule,
                           **({} if pipeline_harvest is None else {"pipeline_harvest": pipeline_harvest}))
    return states, stats


def _skipped(s: ChatResult) -> bool:
    return bool(s.finish_reasons) and s.finish_reasons[0].startswith("skipped")


def _strip_stop(tokens: list[int], stops) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in set(stops) else tokens
