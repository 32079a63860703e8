"""Prompts written by the target itself: ``specheads data synthesize``.

A draft head learns what its target says in answer to what users ask; few
prompt sets are large and varied enough, so the target writes the user turns
too. Its chat template is rendered up to where a user message's text begins
(a sentinel user message, cut at the sentinel) and the target continues from
there; the template's own end-of-user-turn token, found after the sentinel,
ends the message. A message that does not end within ``max_new_tokens`` is
dropped (counted as ``no_end``).

The mix is steered by categories (chat, reasoning, math, code, writing, QA,
...) from a seed file: each item picks a category by weight, a system prompt
and an opener (the first words of the user message, continued by the target).
A share of the items are copy-heavy requests instead (summarize, rewrite,
translate, extract, answer from context, continue code), where a draft head
loses most to n-gram drafting: a template wraps a document, written by the
target or taken from the user's file. With ``turns`` > 1 the target answers
and then writes the next user turn, until the conversation has that many.

Filters drop empty, too short or too long turns, degenerate text (repetition,
mostly non-letters, echoes of the system prompt), exact duplicates and near
duplicates (MinHash LSH over word 3-grams); every drop is counted with its
reason and kept, with its text, in ``<out>.dropped.jsonl``.

Deterministic for a seed: item i's plan and sampling seeds come from (seed, i)
alone, and items are judged in index order (a near duplicate is the later of
two), so the output does not depend on the batch size or on where a previous
run stopped. Resumable: kept and dropped rows are appended (fsynced) as judged;
a rerun skips the items recorded in either file, cuts a torn last line off, sets
a corrupted line aside (``<out>.bad.jsonl``, keeping the good ones around it) and
continues. The ``.meta.json`` sidecar refuses a file written with other
settings or another seed file (see :mod:`specheads.data.appendlog`).

Output rows ``{"id", "category", "turns": [...], "system"?}`` are plain prompt
records: point ``data.sources`` of a regenerate recipe at the file.
"""

from __future__ import annotations

from specheads.config import CopyTask, SeedCategory
from specheads.errors import SpecheadsError
from specheads.fileio import disk_full_guard, write_json_atomic
from specheads.rundir import RunDir, stage_inputs, stage_lock

import hashlib
import json
import random
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import yaml
from pydantic import ValidationError

from .appendlog import append_rows, check_recipe_inputs, check_settings, read_rows
from .sources import resolve_source
from .template import TemplateError, render, tokenizer_name

OUT_KEY = "data.synthesize.out"
COMMAND = "specheads data synthesize"
SUMMARY_NAME = "synthesize_summary.json"
PLOT_NAME = "synthesize_categories.png"
# stands in for a user message's text; plain ASCII, so no template trims or escapes it
SENTINEL = "SPECHEADSUSERTEXT7F3A"
# give up after this many items per requested prompt (a target that never ends its messages)
ATTEMPTS_PER_PROMPT = 4
# a continuation task shows the first part of a document and asks for the rest
CONTINUE_TASKS = {"continue_code"}
COPY_TASKS = set(get_args(CopyTask))


class SynthesizeError(SpecheadsError, ValueError):
    """Synthesis cannot start or resume (no user turn in the template, bad seed file, another recipe's output)."""


# --------------------------------------------------------------------------- seeds


@dataclass
class Category:
    name: str
    weight: float
    systems: list[str]
    openers: list[str]
    topics: list[str]


@dataclass
class Seeds:
    categories: list[Category]
    documents: dict[str, list[str]]            # prose / code requests, topics / code_topics
    copy_templates: dict[str, list[str]]       # task -> templates with {document}
    sha256: str                                # of the seed file: recorded, a changed file is refused


def load_seeds(cfg) -> Seeds:
    """The seed file of ``cfg`` (``data.synthesize``) with the recipe's category overrides merged in."""
    path = resolve_source(cfg.seeds)
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw) or {}  # YAML reads JSON too
    except yaml.YAMLError as e:
        raise SynthesizeError(f"{path}: not valid YAML/JSON: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict) or set(doc) - {"categories", "documents", "copy_tasks"}:
        raise SynthesizeError(f"{path}: expected a mapping with categories, documents, copy_tasks")
    merged: dict[str, dict] = {}
    for name, entry in (doc.get("categories") or {}).items():
        try:
            merged[str(name)] = SeedCategory.model_validate(entry or {}).model_dump()
        except ValidationError as e:
            err = e.errors()[0]
            raise SynthesizeError(f"{path}: categories.{name}.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    for name, over in cfg.categories.items():  # the recipe's fields win
        base = merged.setdefault(name, SeedCategory().model_dump())
        base.update({k: v for k, v in over.model_dump().items() if v is not None})
    cats = []
    for name, c in merged.items():
        where = f"category {name!r} (data.synthesize.categories / {path.name})"
        if c["weight"] is None:
            raise SynthesizeError(f"{where} has no weight")
        if c["weight"] == 0:
            continue
        if not c["openers"]:
            raise SynthesizeError(f"{where} has no openers (use [\"\"] to let the target start the message)")
        if any("{topic}" in o for o in c["openers"]) and not c["topics"]:
            raise SynthesizeError(f"{where} has openers with {{topic}} but no topics")
        cats.append(Category(name, float(c["weight"]), c["systems"] or [""], c["openers"], c["topics"] or []))
    if not cats and cfg.copy_tasks.fraction < 1:
        raise SynthesizeError(f"no category with a weight > 0 in {path} and data.synthesize.categories")
    documents = doc.get("documents") or {}
    templates = doc.get("copy_tasks") or {}
    if cfg.copy_tasks.fraction > 0:
        for task in cfg.copy_tasks.tasks:
            t = templates.get(task)
            if not t or not all(isinstance(x, str) and "{document}" in x for x in t):
                raise SynthesizeError(f"{path}: copy_tasks.{task} needs a list of templates containing {{document}}")
        if cfg.copy_tasks.documents is None:
            for key in ("prose", "code", "topics", "code_topics"):
                if not documents.get(key):
                    raise SynthesizeError(f"{path}: documents.{key} is missing (the target writes the documents of "
                                          f"copy-heavy tasks unless data.synthesize.copy_tasks.documents names a file)")
    return Seeds(cats, documents, templates, hashlib.sha256(raw).hexdigest())


def load_documents(path_text: str, seed: int) -> list[str]:
    """Documents to wrap: JSON/JSONL rows with ``text`` (or ``document`` / ``content``), a JSON list of
    strings, a directory of text files (one document each), or any other file as one document.

    Returned in a seeded order: item i wraps document i mod n, so each is used once before any
    is used again."""
    path = Path(path_text)
    where = "data.synthesize.copy_tasks.documents"
    if not path.exists():
        raise SynthesizeError(f"{where}: {path} not found")
    if path.is_dir():
        docs = []
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            try:
                docs.append(f.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise SynthesizeError(f"{where}: {f} is not UTF-8 text") from None
    elif path.suffix.lower() in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        try:
            rows = json.loads(text) if path.suffix.lower() == ".json" else [
                json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise SynthesizeError(f"{where}: {path} is not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise SynthesizeError(f"{where}: {path}: expected a list of strings or rows with 'text'")
        docs = []
        for i, r in enumerate(rows, 1):
            text = r if isinstance(r, str) else next(
                (r[k] for k in ("text", "document", "content") if isinstance(r, dict) and isinstance(r.get(k), str)), None)
            if text is None:
                raise SynthesizeError(f"{where}: {path}, row {i}: expected a string or a 'text' field")
            docs.append(text)
    else:
        docs = [path.read_text(encoding="utf-8")]
    docs = [d.strip() for d in docs if d.strip()]
    if not docs:
        raise SynthesizeError(f"{where}: no non-empty documents in {path}")
    random.Random(f"documents:{seed}").shuffle(docs)
    return docs


# --------------------------------------------------------------------------- the template's user turn


def user_prefix(tokenizer, messages: list[dict]) -> str:
    """The rendering of ``messages`` followed by a user turn, up to where its text begins."""
    text = render(tokenizer, messages + [{"role": "user", "content": SENTINEL}])
    return text[: text.index(SENTINEL)]


def _special_tokens(tokenizer) -> dict[str, int]:
    tokens = {t: tokenizer.convert_tokens_to_ids(t) for t in getattr(tokenizer, "all_special_tokens", []) or []}
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            tokens[str(tok)] = int(tid)
    return {t: i for t, i in tokens.items() if t and i is not None}


def user_turn_stops(tokenizer, where: str) -> list[int]:
    """The token ids that end a user message; refuses a template without a user turn.

    The end marker is the first special token the template writes after a user message's text
    (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3)."""
    name = f"the chat template of {where} ({tokenizer_name(tokenizer)})"
    try:
        text = render(tokenizer, [{"role": "user", "content": SENTINEL}])
    except TemplateError as e:
        raise SynthesizeError(f"{name} cannot render a user turn: {e}") from None
    if SENTINEL not in text:
        raise SynthesizeError(f"{name} has no user turn (a user message's text does not appear in its rendering); "
                              f"the target cannot write user messages with it")
    after = text[text.index(SENTINEL) + len(SENTINEL):]
    found = [(after.find(t), t, i) for t, i in _special_tokens(tokenizer).items() if t in after]
    if not found:
        raise SynthesizeError(f"{name} writes no special token after a user message ({after!r}), so the end of a "
                              f"message the target writes cannot be told; set target.chat_template")
    return [min(found)[2]]


def _ids(tokenizer, text: str) -> list[int]:
    # the rendered template holds any BOS it wants (as servers tokenize it)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- one item's plan


@dataclass
class Item:
    index: int
    id: str
    category: str
    system: str = ""
    opener: str = ""
    copy_task: str | None = None
    template: str | None = None
    document: str | None = None
    doc_request: str | None = None             # when the target writes the document
    messages: list[dict] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    reason: str | None = None                  # why it was dropped

    def row(self) -> dict:
        r = {"id": self.id, "category": self.category, "turns": self.turns}
        if self.system:
            r["system"] = self.system
        return r

    def dropped_row(self) -> dict:
        return {"id": self.id, "category": self.category, "reason": self.reason, "turns": self.turns}


def item_id(seed: int, index: int) -> str:
    return f"synth-{seed}-{index}"


def plan_item(index: int, seed: int, seeds: Seeds, cfg, documents: list[str] | None) -> Item:
    """What item ``index`` asks for: a pure function of (seed, index), whatever the batching
    (``documents``: as :func:`load_documents` orders them)."""
    rng = random.Random(f"synthesize:{seed}:{index}")  # str seeds hash with sha512: stable across processes
    iid = item_id(seed, index)
    ct = cfg.copy_tasks
    if ct.fraction > 0 and (rng.random() < ct.fraction or not seeds.categories):
        task = rng.choice(ct.tasks)
        it = Item(index, iid, task, copy_task=task, template=rng.choice(seeds.copy_templates[task]))
        if documents:
            it.document = documents[index % len(documents)]  # already in a seeded order
        else:
            kind, topics = ("code", "code_topics") if task in CONTINUE_TASKS else ("prose", "topics")
            it.doc_request = rng.choice(seeds.documents[kind]).replace("{topic}", rng.choice(seeds.documents[topics]))
        return it
    cat = rng.choices(seeds.categories, weights=[c.weight for c in seeds.categories])[0]
    system = rng.choice(cat.systems)
    opener = rng.choice(cat.openers)
    if "{topic}" in opener:
        opener = opener.replace("{topic}", rng.choice(cat.topics))
    it = Item(index, iid, cat.name, system=system.strip(), opener=opener.rstrip())
    if it.system:
        it.messages.append({"role": "system", "content": it.system})
    return it


# --------------------------------------------------------------------------- copy-heavy prompts


def trim_to_boundary(text: str) -> str:
    """Cut a document that hit its length cap back to its last line break or sentence end."""
    text = text.rstrip()
    cut = max(text.rfind("\n"), *(text.rfind(p) + 1 for p in (". ", "! ", "? ")), text.rfind(".") + 1)
    return text[:cut].rstrip() if cut > len(text) // 2 else text


def continuation_prefix(document: str) -> str:
    """The first ~60% of a document, cut at a line break (or a space), for 'continue this' requests."""
    lines = document.splitlines()
    if len(lines) >= 3:
        return "\n".join(lines[: max(1, round(len(lines) * 0.6))])
    cut = document.rfind(" ", 0, int(len(document) * 0.6))
    return document[:cut] if cut > 0 else document


def copy_prompt(task: str, template: str, document: str, tokenizer, max_tokens: int) -> str:
    """``template`` with ``document`` in place of {document}, the document cut so the request has at most
    ``max_tokens`` tokens (at a whitespace, so no word is split)."""
    if task in CONTINUE_TASKS:
        document = continuation_prefix(document)
    room = max_tokens - len(_ids(tokenizer, template.replace("{document}", "")))
    if room <= 0:
        raise SynthesizeError(f"data.synthesize.copy_tasks.max_prompt_tokens={max_tokens} leaves no room for a "
                              f"document in the {task} template {template[:40]!r}")
    ids = _ids(tokenizer, document)
    if len(ids) > room:
        document = tokenizer.decode(ids[:room])
        cut = max(document.rfind("\n"), document.rfind(" "))
        document = document[:cut] if cut > 0 else document
        # decoding then re-encoding can merge tokens differently: trim until it fits
        while document and len(_ids(tokenizer, document)) > room:
            document = document[: document.rfind(" ")] if " " in document else document[: len(document) // 2]
    return template.replace("{document}", document.strip())


# --------------------------------------------------------------------------- filters


def normalized_text(text: str) -> str:
    return " ".join(text.lower().split())


def word_shingles(text: str) -> set[str]:
    """The word 3-grams whose Jaccard similarity makes two texts near-duplicates (data.synthesize.dedup_threshold)."""
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))} if words else set()


def degenerate_reason(text: str, min_chars: int, max_chars: int, echo: list[str]) -> str | None:
    """Why a user turn is not worth keeping (None: it is). ``echo``: normalized lines it must not repeat."""
    t = text.strip()
    if not t:
        return "empty"
    if len(t) < min_chars:
        return "too_short"
    if len(t) > max_chars:
        return "too_long"
    chars = [c for c in t if not c.isspace()]
    if sum(c.isalpha() for c in chars) < 0.4 * len(chars):
        return "non_letters"
    words = t.lower().split()
    if len(words) >= 12:
        grams = list(zip(words, words[1:], words[2:]))
        if len(set(grams)) < 0.5 * len(grams):  # a loop: most 3-grams seen before
            return "repetitive"
    if re.search(r"(.)\1{19}", t):  # one character 20 times in a row
        return "repetitive"
    norm = normalized_text(t)
    if any(line in norm for line in echo):
        return "echoes_system"
    return None


def echo_lines(prefix: str, system: str, specials) -> list[str]:
    """Lines of the rendered prefix (a template's default system prompt) and the item's system prompt that
    a user message must not repeat; short lines ('user', 'system') are not telling."""
    for s in specials:
        prefix = prefix.replace(s, "\n")
    return [n for n in (normalized_text(x) for x in prefix.splitlines() + [system]) if len(n) >= 20]


class Deduper:
    """Exact (normalized text) and near-duplicate (MinHash LSH over word 3-grams) detection, in order."""

    def __init__(self, threshold: float, num_perm: int = 128):
        from datasketch import MinHashLSH

        self.threshold, self.num_perm = threshold, num_perm
        self.exact: set[str] = set()
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.hashes: dict = {}

    def admit(self, key: str, text: str) -> str | None:
        """None and remember ``text`` when it is new; else the reason it is a duplicate (nothing remembered)."""
        from datasketch import MinHash

        norm = normalized_text(text)
        digest = hashlib.sha256(norm.encode()).hexdigest()
        if digest in self.exact:
            return "exact_duplicate"
        shingles = word_shingles(norm)
        if shingles:
            m = MinHash(num_perm=self.num_perm, seed=1)
            m.update_batch([s.encode() for s in sorted(shingles)])
            # LSH finds candidates; the MinHash estimate confirms them (LSH alone has false positives)
            if any(m.jaccard(self.hashes[c]) >= self.threshold for c in self.lsh.query(m)):
                return "near_duplicate"
            self.lsh.insert(key, m)
            self.hashes[key] = m
        self.exact.add(digest)
        return None


def dedup_text(turns: list[str]) -> str:
    return "\n".join(turns)


# --------------------------------------------------------------------------- generation


class _Writer:
    """Writes items with the engine under continuous batching: an item's generations (its document,
    user turns, answers between turns) are requests in turn, the next one queued as the last finishes."""

    def __init__(self, engine, tokenizer, cfg, seed: int, stops: list[int]):
        self.engine, self.tok, self.cfg, self.seed = engine, tokenizer, cfg, seed
        self.user_stops = sorted(set(stops) | set(engine.args.eos_token_ids))
        self.specials = list(_special_tokens(tokenizer))
        self.tokens = 0

    def _text(self, toks: list[int], stops) -> str:
        if toks and toks[-1] in stops:
            toks = toks[:-1]
        return self.tok.decode(toks, skip_special_tokens=True)

    def _accept_turn(self, it: Item, text: str) -> None:
        prefix = user_prefix(self.tok, it.messages)
        it.reason = degenerate_reason(text, self.cfg.min_chars, self.cfg.max_chars,
                                      echo_lines(prefix, it.system, self.specials))
        it.turns.append(text.strip())
        if it.reason is None:
            it.messages.append({"role": "user", "content": text.strip()})

    def _generate(self, it: Item, prompt: list[int], max_new: int, stops, step: int):
        """``yield from`` this in ``_flow``: one generation as a ``Request`` (``step`` keeps each
        generation's seed apart; ``stops`` None = EOS); gives (tokens, finish reason), or None
        when it does not fit the cache (the item is then dropped as 'overlong')."""
        from specheads.runtime.chat import seed_for
        from specheads.runtime.engines.continuous import Request

        if len(prompt) + max_new + 1 > self.engine.max_seq:
            it.reason = "overlong"
            return None
        return (yield Request(prompt, max_new, seed=seed_for(it.id, self.seed, step), stop_token_ids=stops))

    def _flow(self, it: Item):
        """One item's generations (``_generate``); returns when the item is complete or dropped."""
        g, tok, eos = self.cfg, self.tok, self.engine.args.eos_token_ids
        if it.doc_request:  # 1. the document of a copy-heavy item (its own sampling stream, step 1000)
            prompt = _ids(tok, render(tok, [{"role": "user", "content": it.doc_request}], add_generation_prompt=True))
            got = yield from self._generate(it, prompt, g.copy_tasks.document_tokens, None, 1000)
            if got is None:
                return
            toks, why = got
            text = self._text(toks, eos)
            it.document = trim_to_boundary(text) if why == "length" else text.strip()
            # a few words make no copy-heavy request
            if len(toks) < max(8, g.copy_tasks.document_tokens // 4) or not it.document:
                it.reason = "short_document"
                return
        for turn in range(g.turns):
            if turn > 0:  # 2. the target answers the last user turn (context for the next one)
                prompt = _ids(tok, render(tok, it.messages, add_generation_prompt=True))
                got = yield from self._generate(it, prompt, g.answer_tokens, None, 2 * turn - 1)
                if got is None:
                    return
                it.messages.append({"role": "assistant", "content": self._text(got[0], eos).strip()})
            # 3. the user turn: a copy-heavy request, or written by the target from the template's user prefix
            if turn == 0 and it.copy_task:
                self._accept_turn(it, copy_prompt(it.copy_task, it.template, it.document, tok,
                                                  g.copy_tasks.max_prompt_tokens))
            else:
                opener = it.opener if turn == 0 else ""
                prompt = _ids(tok, user_prefix(tok, it.messages) + opener)
                got = yield from self._generate(it, prompt, g.max_new_tokens, self.user_stops, 2 * turn)
                if got is None:
                    return
                toks, why = got
                text = opener + self._text(toks, self.user_stops)
                if why != "stop":  # the message never ended within the length cap
                    it.reason = "no_end"
                    it.turns.append(text.strip())
                    return
                self._accept_turn(it, text)
            if it.reason is not None:
                return

    def _count(self, n: int) -> None:
        self.tokens += n

    def run(self, items, on_item) -> None:
        """Generate every item of ``items`` (pulled as slots free up); ``on_item(item)`` as each is complete."""
        from specheads.runtime.engines.continuous import generate_flows

        g = self.cfg
        generate_flows(self.engine, ((it, self._flow(it)) for it in items), on_item, on_tokens=self._count,
                       temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                       use_cuda_graphs=self.engine.device.type == "cuda", refill_at=g.refill_at)


def _max_seq(cfg, prefix_len: int, user_documents: bool, limit: int) -> int:
    """Cache positions the longest conversation can need; longer ones are dropped as 'overlong'."""
    ct = cfg.copy_tasks
    first = prefix_len + 32 + cfg.max_new_tokens
    doc = 0
    if ct.fraction > 0:
        copy = ct.max_prompt_tokens if user_documents else min(ct.max_prompt_tokens, ct.document_tokens + 96)
        first = max(first, prefix_len + copy + 16)
        doc = 0 if user_documents else prefix_len + 96 + ct.document_tokens
    need = first + (cfg.turns - 1) * (cfg.answer_tokens + cfg.max_new_tokens + 96)
    need = max(need + (cfg.answer_tokens if cfg.turns > 1 else 0), doc) + 8
    return min(need, limit)


# --------------------------------------------------------------------------- the stage


def dropped_path(out: Path) -> Path:
    return out.with_name(out.name + ".dropped.jsonl")


def summarize(cfg, kept: list[dict], dropped: list[dict]) -> dict:
    reasons = Counter(r["reason"] for r in dropped)
    dups = reasons["exact_duplicate"] + reasons["near_duplicate"]
    per_cat: dict[str, dict] = {}
    for rows, key in ((kept, "written"), (dropped, "dropped")):
        for r in rows:
            per_cat.setdefault(r["category"], {"written": 0, "dropped": 0})[key] += 1
    return {"requested": cfg.num_prompts, "written": len(kept), "attempts": len(kept) + len(dropped),
            "dropped": dict(sorted(reasons.items())), "dropped_total": len(dropped),
            # of the prompts that passed every other filter, the share that repeated an earlier one
            "near_duplicate_rate": dups / (len(kept) + dups) if kept or dups else 0.0,
            "copy_heavy": sum(r["category"] in COPY_TASKS for r in kept),
            "multi_turn": sum(len(r["turns"]) > 1 for r in kept),
            "per_category": dict(sorted(per_cat.items()))}


def plot_categories(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(summary["per_category"])
    written = [summary["per_category"][c]["written"] for c in cats]
    dropped = [summary["per_category"][c]["dropped"] for c in cats]
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(cats) + 2), 3.5))
    ax.bar(cats, written, label="written")
    ax.bar(cats, dropped, bottom=written, label="dropped", color="lightgray")
    ax.set_ylabel("prompts")
    ax.set_title(f"synthesized prompts by category ({summary['written']} written, "
                 f"near-duplicate rate {summary['near_duplicate_rate']:.1%})")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@stage_lock("synthesize")
def run_synthesize(recipe, target=None) -> dict:
    """Prompts written by the target (``data.synthesize``), appended to ``RunDir(recipe).synthesized``;
    a rerun continues where the last one stopped. Returns the run's summary."""
    from tqdm import tqdm

    from specheads.target import load_target_for, load_tokenizer_for

    cfg = recipe.data.synthesize
    out = RunDir(recipe).synthesized
    # everything that can be wrong with the inputs fails here, before any weights load
    seeds = load_seeds(cfg)
    documents = (load_documents(cfg.copy_tasks.documents, recipe.seed)
                 if cfg.copy_tasks.documents and cfg.copy_tasks.fraction else None)
    check_recipe_inputs(out, recipe, "synthesize", SynthesizeError, OUT_KEY)
    tokenizer = target.tokenizer if target is not None else load_tokenizer_for(recipe)
    ct = recipe.target.chat_template  # a file is named by its path, an inline Jinja string by its key
    stops = user_turn_stops(tokenizer, (ct if "{" not in ct else "target.chat_template") if ct else recipe.target.source)
    # the longest user prefix (system prompts differ in length) sizes the cache
    prefix_len = max(len(_ids(tokenizer, user_prefix(tokenizer, [{"role": "system", "content": s}] if s else [])))
                     for s in {s.strip() for c in seeds.categories for s in c.systems} | {""})
    if target is None:
        target = load_target_for(recipe)
    settings = {"target": {"name": target.name, "config_hash": target.config_hash},
                "seeds_sha256": seeds.sha256,
                "documents_sha256": hashlib.sha256("\0".join(documents).encode()).hexdigest() if documents else None,
                "recipe_inputs": stage_inputs(recipe, "synthesize")}
    check_settings(out, settings, SynthesizeError, OUT_KEY, COMMAND)
    drop_out = dropped_path(out)
    kept = read_rows(out, ("id", "turns"), SynthesizeError)
    dropped = read_rows(drop_out, ("id", "reason"), SynthesizeError)
    done = {r["id"] for r in kept} | {r["id"] for r in dropped}
    dedup = Deduper(cfg.dedup_threshold)
    for r in kept:
        dedup.admit(r["id"], dedup_text(r["turns"]))

    engine = _engine(target, cfg, prefix_len, documents is not None)
    writer = _Writer(engine, tokenizer, cfg, recipe.seed, stops)
    already = len(kept)
    max_index = ATTEMPTS_PER_PROMPT * cfg.num_prompts
    bar = tqdm(total=cfg.num_prompts, initial=min(already, cfg.num_prompts), desc="synthesize", unit="prompt",
               smoothing=0)
    t0, index, new_dropped = time.time(), 0, 0
    pending: deque[Item] = deque()  # items handed to the writer, in index order, not judged yet
    complete: set[int] = set()

    def items():
        nonlocal index
        while len(kept) < cfg.num_prompts and index < max_index:
            if item_id(recipe.seed, index) not in done:
                it = plan_item(index, recipe.seed, seeds, cfg, documents)
                pending.append(it)
                yield it
            index += 1

    def judge(finished: Item) -> None:
        """Judge the complete items at the head of ``pending`` in index order, so a near duplicate is
        always the later item whatever finished first, and append them (fsynced)."""
        nonlocal new_dropped
        complete.add(finished.index)
        keep, drop = [], []
        while pending and pending[0].index in complete:
            it = pending.popleft()
            complete.discard(it.index)
            if len(kept) + len(keep) >= cfg.num_prompts:
                continue  # items past the last one needed stay unrecorded (a larger num_prompts takes them)
            if it.reason is None:
                it.reason = dedup.admit(it.id, dedup_text(it.turns))
            (drop if it.reason else keep).append(it)
        if keep:
            append_rows(f_out, out, [it.row() for it in keep], SynthesizeError, f"{len(kept)} prompts")
        if drop:
            append_rows(f_drop, drop_out, [it.dropped_row() for it in drop], SynthesizeError,
                        f"{len(kept) + len(keep)} prompts")
        kept.extend(it.row() for it in keep)
        dropped.extend(it.dropped_row() for it in drop)
        new_dropped += len(drop)
        if keep or drop:
            bar.update(len(keep))
            bar.set_postfix(dropped=new_dropped, tok_s=f"{writer.tokens / max(1e-9, time.time() - t0):.0f}")

    with open(out, "a", encoding="utf-8") as f_out, open(drop_out, "a", encoding="utf-8") as f_drop:
        try:
            writer.run(items(), judge)
        finally:
            bar.close()
    return _finish(cfg, out, drop_out, kept, dropped, already, writer.tokens, time.time() - t0, max_index)


def _engine(target, cfg, prefix_len: int, with_documents: bool):
    """The generation engine, its cache sized for the longest conversation ``cfg`` can write."""
    import torch

    from specheads.runtime.model import KVCacheTooLarge, TargetModel

    limit = int(getattr(target.config, "max_position_embeddings", 8192) or 8192)
    max_seq = _max_seq(cfg, prefix_len, with_documents, limit)
    try:
        engine = TargetModel.from_hf(target.model, max_batch=cfg.batch_size, max_seq=max_seq,
                                     dtype=getattr(torch, cfg.dtype) if cfg.dtype else None)
    except KVCacheTooLarge as e:
        fix = f"set data.synthesize.batch_size <= {e.fits}, or lower" if e.fits else "not one row fits: lower"
        raise SynthesizeError(f"data.synthesize.batch_size={cfg.batch_size}: {e}: {fix} "
                              f"data.synthesize.max_new_tokens, turns or copy_tasks.document_tokens") from None
    if cfg.compile:
        engine.compile_layers()
    return engine


def _finish(cfg, out: Path, drop_out: Path, kept: list, dropped: list, already: int, tokens: int, elapsed: float,
            max_index: int) -> dict:
    """The run's summary (and category plot) beside the output, and its one line for the user."""
    summary = {"out": str(out), "dropped_file": str(drop_out), **summarize(cfg, kept, dropped),
               "already_done": already, "generated_tokens": tokens, "seconds": elapsed,
               "tokens_per_s": tokens / elapsed if elapsed else 0.0,
               "stopped_at_attempt_limit": len(kept) < cfg.num_prompts}
    summary_path = out.parent / SUMMARY_NAME
    with disk_full_guard(summary_path, error=SynthesizeError,
                         kept=f"every synthesized prompt is safely written to {out}; only this summary is missing"):
        write_json_atomic(summary_path, summary)
    with disk_full_guard(out.parent / PLOT_NAME, error=SynthesizeError,
                         kept=f"every synthesized prompt is safely written to {out} and the summary to {summary_path}; "
                              f"only the plot is missing"):
        plot_categories(summary, out.parent / PLOT_NAME)
    reasons = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items()) or "none"
    print(f"synthesized {summary['written']} prompts ({summary['written'] - already} this run, {tokens} tokens, "
          f"{summary['tokens_per_s']:.0f} tok/s); dropped {summary['dropped_total']} ({reasons}); near-duplicate "
          f"rate {summary['near_duplicate_rate']:.1%} -> {out}")
    if summary["stopped_at_attempt_limit"]:
        print(f"stopped after {max_index} attempts ({ATTEMPTS_PER_PROMPT} per requested prompt): most messages were "
              f"dropped, see {summary_path} and {drop_out}")
    return summary
