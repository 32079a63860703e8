"""Chat template + assistant-only loss mask.

A token row is the conversation exactly as the server renders it (the
tokenizer's chat template, or one supplied), tokenized once, with a loss mask
that covers exactly what the model generates in assistant turns: the
assistant content and the end-of-turn token(s) the template appends after it
(``<|im_end|>``, ``<|eot_id|>``, ``</s>`` ...), because the draft must learn to
predict the end of a turn. Not masked: system prompts (including a default
system prompt the template injects, e.g. SmolLM2's "You are a helpful AI
assistant named SmolLM..."; it stays in the row, as the server sees it), user
turns, the generation-prompt header (``<|im_start|>assistant\\n``) and
whitespace the template writes after the end-of-turn token (the ``\\n`` after
``<|im_end|>``: the model stops at ``<|im_end|>`` and never generates it).

The spans come from the template itself, never from hard-coded separators:

1. render ``messages[:i]`` with ``add_generation_prompt=True`` -> where the
   assistant turn ``i`` starts; render ``messages[:i+1]`` -> where it ends;
   both must be prefixes of the rendering of the whole conversation (the
   prefix property, true of ChatML, Llama-3, Mistral, Gemma ... templates);
2. a template that is not prefix-stable for a turn (Qwen3 strips ``<think>``
   blocks from assistant turns before the last user turn, so an assistant
   turn renders differently once it is history) falls back, for that turn,
   to finding the assistant content (verbatim, else stripped) in the full
   rendering after the turn's context, plus the special token that closes
   it. If the content cannot be found either, :class:`TemplateError`.

The full rendering is tokenized once with ``add_special_tokens=False`` and
``return_offsets_mapping=True``; a token is masked when its character span
lies inside an assistant span. ``add_special_tokens=False`` is what vLLM and
SGLang do with a rendered chat prompt: templates that want a BOS write it
themselves (Llama-3 renders ``<|begin_of_text|>``), so it is never doubled.
"""

from __future__ import annotations

from typing import Any

from specheads.errors import SpecheadsError

__all__ = ["TemplateError", "tokenize_conversation", "render", "assistant_spans", "tokenizer_name"]


class TemplateError(SpecheadsError, ValueError):
    """The chat template cannot render the conversation, or assistant spans cannot be located."""


def tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _template_for(tokenizer: Any, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise TemplateError(
            f"tokenizer '{tokenizer_name(tokenizer)}' has no chat template; supply one "
            "(chat_template=..., or the recipe's target.chat_template)"
        )
    return template


def render(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = False, chat_template: str | None = None) -> str:
    """The template's rendering of ``messages`` as text."""
    template = _template_for(tokenizer, chat_template)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja2 errors, raise_exception(...) in templates
        roles = "/".join(m["role"] for m in messages)
        raise TemplateError(
            f"chat template of '{tokenizer_name(tokenizer)}' failed to render a conversation ({roles}): {e}"
        ) from e
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def assistant_spans(tokenizer: Any, messages: list[dict], chat_template: str | None = None) -> tuple[str, list[tuple[int, int, str]]]:
    """Render ``messages`` and locate each assistant turn.

    Returns ``(text, spans)`` with ``spans = [(start, end, how)]`` character
    ranges into ``text``; ``how`` is ``"prefix"`` (from prefix renders, end =
    end of the turn's rendering, trailing whitespace trimmed later at token
    level) or ``"content"`` (fallback: the content's own range; the closing
    special token is added at token level).
    """
    full = render(tokenizer, messages, chat_template=chat_template)
    spans: list[tuple[int, int, str]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, chat_template=chat_template)
        turn = render(tokenizer, messages[: i + 1], chat_template=chat_template)
        if full.startswith(prompt) and full.startswith(turn) and len(prompt) <= len(turn):
            start, end, how = len(prompt), len(turn), "prefix"
        else:
            # Not prefix-stable for this turn (e.g. Qwen3 re-renders history without
            # <think>): find the content itself in the full rendering, after its context.
            search_from = len(prompt) if full.startswith(prompt) else prev_end
            search_from = max(search_from, prev_end)
            content = m["content"]
            pos = full.find(content, search_from) if content else -1
            if pos < 0 and content.strip():
                content = content.strip()
                pos = full.find(content, search_from)
            if pos < 0:
                raise TemplateError(
                    f"chat template of '{tokenizer_name(tokenizer)}' is not prefix-stable at message {i} "
                    "(rendering messages[:i] / messages[:i+1] is not a prefix of the whole conversation), "
                    "and the assistant content does not appear verbatim in the rendering either; "
                    "cannot locate the assistant turn for the loss mask"
                )
            start, end, how = pos, pos + len(content), "content"
        spans.append((start, end, how))
        prev_end = end
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict],
    max_length: int,
    chat_template: str | None = None,
) -> dict:
    """``{"input_ids": list[int], "loss_mask": list[int], "truncated": bool}``.

    ``loss_mask[t] == 1`` where token ``t`` is generated by the assistant (see
    the module docstring). Rows longer than ``max_length`` are cut at
    ``max_length`` tokens (``truncated=True``). A row can end up with no masked
    token (prompt-only conversation, or the answer cut off): the caller skips
    and counts it.
    """
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    text, spans = assistant_spans(tokenizer, messages, chat_template)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise TemplateError(
            f"tokenizer '{tokenizer_name(tokenizer)}' cannot return offsets (a slow tokenizer?); "
            "the loss mask needs a fast (tokenizers-backed) tokenizer"
        ) from e
    ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    special = _special_ids(tokenizer)

    first = 0  # spans are in order: resume the token scan where the last one stopped
    for start, end, how in spans:
        members = []
        while first < len(offsets) and offsets[first][1] <= start and offsets[first][1] > offsets[first][0]:
            first += 1
        for t in range(first, len(offsets)):
            a, b = offsets[t]
            if a >= end:
                break
            if (a >= start and b <= end and b > a) or (a == b and start < a < end):
                members.append(t)
        if how == "content" and members:
            # fallback spans cover the content only: add the end-of-turn token, i.e.
            # the first token after the content (skipping whitespace) if it is special
            t = members[-1] + 1
            while t < len(ids) and ids[t] not in special and not text[offsets[t][0] : offsets[t][1]].strip():
                t += 1
            if t < len(ids) and ids[t] in special:
                members.extend(range(members[-1] + 1, t + 1))
        # drop whitespace the template writes after the end-of-turn token
        # ("<|im_end|>" + "\n"): only whitespace-only tokens after the last special one
        last_special = max((k for k, t in enumerate(members) if ids[t] in special), default=None)
        if last_special is not None and all(
            not text[offsets[t][0] : offsets[t][1]].strip() for t in members[last_special + 1 :]
        ):
            del members[last_special + 1 :]
        for t in members:
            mask[t] = 1

    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}

