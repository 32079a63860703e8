"""Build the mixed evaluation prompt set, specheads/assets/eval_mixed.jsonl.

    .venv/bin/python benchmarks/build_eval_set.py --data DATA --out specheads/assets/eval_mixed.jsonl

Seven categories (chat, qa, math, code, summarization, extraction, translation), each prompt
with the `category` the eval stage reports τ by. The copy-heavy ones wrap one or more
documents into a request; their wordings are our own, not the training templates of
`synthesize_seeds.yaml` (copy_tasks).

Every prompt and every document comes from a row that the training recipe holds out:
`is_holdout(id, 0.05)` with the ids the loaders assign, so a recipe training on these
files with `data.holdout_fraction: 0.05` never sees them. A held-out row whose text also
occurs in a training row (the files repeat themselves, sharegpt_dummy above all) is
skipped as well. Each output row names its source rows ("file:id", `;`-separated).

Deterministic: the same data gives the same file, byte for byte (tests/test_eval_set.py).
DATA is the folder of the public prompt files the GPU recipe reads (default ./data; see BENCHMARKS.md).
The program never reads DATA at run time; the built file is the asset.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specheads.data.formats import load_conversations
from specheads.data.sources import is_holdout

SEED = 13
HOLDOUT_FRACTION = 0.05  # the reference recipe's data.holdout_fraction
FILES = ["gsm8k_train.jsonl", "code_alpaca_2k.json", "new_codealpaca.json", "arena_hard_v2_questions.jsonl",
         "sharegpt_dummy_conversations.json", "alpaca_seed_tasks.jsonl"]  # not vicuna_bench: its own eval set
CATEGORIES = ["chat", "qa", "math", "code", "summarization", "extraction", "translation"]
MAX_DOC_CHARS = 5000  # keeps the longest prompts near 1,500 SmolLM2 tokens

# Held-out arena-hard rows, sorted by hand after reading them (English only: SmolLM2 is
# English-only, and a prompt it cannot read measures nothing but its babble).
ARENA = {
    "chat": ["0a055d8b33ca49b1", "6b7896a92b0e492a", "5db4ecd74f604816", "76ab11208b4e4732", "199ee703dfb7418e",
             "6b815351745040ca", "950ba8cc3cc44bf6", "a817b29a2893490c", "972bf36d029a488d"],
    "qa": ["8d06d08f63e64e56", "613c661bb1194ae9", "1d82850e43644140", "4467c7a151bd4e70", "0c15180061754ab9"],
    "math": ["7bb0b31e023f4a6e", "4b9ba55ea5704f0d", "15171b3c0aa34773", "a70456c4dca64faa"],
    "code": ["9d8a4964a985472e", "0f61132b48b04b93", "4db9cb5b14d1499e", "87ceeb1c5ac24218", "b7825d0fc00e4d83",
             "34a4959aaf394767", "44a692fe8481436b", "1a437e47d98f48da"],
    "summarization": ["82301184f6b04742"],  # already a "condense this record" request
    "translation": ["a7c13371eb8a4ad7", "4e161445749f4020"],  # "improve this text", "make these lyrics rhyme"
}
ARENA_DOCS = {"summarization": "350b86ce6d5a4b0c", "summarization_problem": "79fb96a5bee24f82",
              "extraction": "7b5b56fc149849bb"}
# Held-out self-instruct seed tasks: a few everyday requests, one extraction, one equation system.
SEEDS = {"chat": ["seed_task_5", "seed_task_57", "seed_task_67", "seed_task_87", "seed_task_145", "seed_task_147"],
         "extraction": ["seed_task_85"], "math": ["seed_task_144"]}

# Code rows that ask a question about code rather than for code: the qa category.
CODE_QUESTION = re.compile(r"^(What is|What's the output|What would be the (expected )?output|Explain|Which|"
                           r"Describe|Differentiate|Give the)")
CODE_WORDS = re.compile(r"\b(def|function|class|return|import|include|public|func|fn)\b")  # not LaTeX or prose
LANGUAGES = ["Go", "Rust", "Kotlin", "TypeScript", "Ruby"]  # rarely the language of a code_alpaca answer


@dataclass
class Row:
    """One held-out source row: its first user turn and, when the file has one, its answer."""
    file: str
    id: str
    prompt: str
    answer: str | None

    @property
    def source(self) -> str:
        return f"{self.file}:{self.id}"


@dataclass
class EvalPrompt:
    category: str
    text: str
    rows: list[Row]
    documents: list[str] = field(default_factory=list)  # text embedded verbatim (the leak test checks it)


def gsm8k_solution(answer: str) -> str:
    # calculator annotations (<<48/2=24>>) are gsm8k's markup, not text anyone would paste
    text = re.sub(r"<<[^>]*>>", "", answer)
    return re.sub(r"\n#### *(.*)$", r"\nFinal answer: \1", text.strip())


def worked_example(row: Row) -> str:
    return f"Problem: {row.prompt}\nSolution:\n{gsm8k_solution(row.answer)}"


def clip(text: str, limit: int = MAX_DOC_CHARS) -> str:
    """At most `limit` characters, cut at a line end so no sentence is chopped mid-word."""
    if len(text) <= limit:
        return text
    return text[: text.rfind("\n", 0, limit)].rstrip()


def numbered(docs: list[str]) -> str:
    return "\n\n".join(f"[{i}] {d}" for i, d in enumerate(docs, start=1))


def fenced(code: str) -> str:
    return f"```\n{code.strip()}\n```"


def is_single_line(row: Row) -> bool:
    return "\n" not in row.prompt.strip()


def is_code_document(row: Row) -> bool:
    """An answer long enough to be worth copying, and code rather than prose."""
    a = row.answer or ""
    lines = [line for line in a.splitlines() if line.strip()]
    # code lines are indented or end in punctuation; prose (some answers explain instead) ends in words
    code_lines = [line for line in lines if line[0].isspace() or line.rstrip()[-1] in "{};:)"]
    prose_lines = [line for line in lines if re.search(r"[a-z]\. [A-Z]", line)]  # two sentences
    return (300 <= len(a) <= 1500 and len(lines) >= 8 and len(code_lines) >= 0.6 * len(lines)
            and not prose_lines and CODE_WORDS.search(a) is not None)


def round_robin(lists: list[list]):
    """The first item of each list, then the second of each, and so on."""
    for k in range(max(len(x) for x in lists)):
        yield [x[k] for x in lists if k < len(x)]


class Picker:
    """Held-out rows per file, shuffled once; each row goes into at most one eval prompt."""

    def __init__(self, data_dir: Path, seed: int = SEED):
        rng = random.Random(seed)
        self.rows: dict[str, list[Row]] = {}
        training_texts = []
        for name in FILES:
            held = []
            # load_conversations assigns the same ids as load_prompts (one parser), and it keeps
            # the answers, which serve as documents
            for conv in load_conversations(data_dir / name):
                texts = [m["content"] for m in conv["messages"]]
                if is_holdout(conv["id"], HOLDOUT_FRACTION):
                    user = next(m["content"] for m in conv["messages"] if m["role"] == "user")
                    answer = next((m["content"] for m in conv["messages"] if m["role"] == "assistant"), None)
                    held.append(Row(name, conv["id"], user, answer))
                else:
                    training_texts.extend(texts)
            rng.shuffle(held)
            self.rows[name] = held
        # every text a training run may see (prompts, and answers when it does not regenerate);
        # as UTF-8 bytes, which Python searches several times faster than a non-ASCII str
        self.training = "\x00".join(training_texts).encode()
        self.used: set[str] = set()
        self._clean: dict[str, bool] = {}

    def is_clean(self, row: Row) -> bool:
        """Neither the row's prompt nor its answer occurs anywhere in a training row."""
        if row.source not in self._clean:
            texts = [t.strip().encode() for t in (row.prompt, row.answer) if t]
            self._clean[row.source] = not any(t in self.training for t in texts)
        return self._clean[row.source]

    def take(self, files: list[str], n: int, want=lambda row: True) -> list[Row]:
        # interleave the files so that a draw from both code files mixes them
        pool = [r for group in round_robin([self.rows[f] for f in files]) for r in group]
        out = []
        for row in pool:
            if len(out) == n:
                break
            if row.source not in self.used and want(row) and self.is_clean(row):
                self.used.add(row.source)
                out.append(row)
        if len(out) < n:
            raise SystemExit(f"only {len(out)} of {n} usable held-out rows in {', '.join(files)}")
        return out

    def by_id(self, file: str, ids: list[str]) -> list[Row]:
        rows = {r.id: r for r in self.rows[file]}
        out = []
        for i in ids:
            row = rows.get(i)
            if row is None or row.source in self.used or not self.is_clean(row):
                raise SystemExit(f"{file}:{i} is not an unused, held-out row of its own")
            self.used.add(row.source)
            out.append(row)
        return out


GSM8K = ["gsm8k_train.jsonl"]
CODE = ["code_alpaca_2k.json", "new_codealpaca.json"]
ARENA_FILE = "arena_hard_v2_questions.jsonl"
SEED_FILE = "alpaca_seed_tasks.jsonl"


def plain(category: str, rows: list[Row]) -> list[EvalPrompt]:
    """Rows whose own prompt already is an eval prompt of the category."""
    return [EvalPrompt(category, r.prompt, [r]) for r in rows]


def wrap(category: str, templates: list[str], rows: list[Row], doc, **fmt) -> list[EvalPrompt]:
    """One prompt per row: templates in turn, `{doc}` replaced by doc(row)."""
    out = []
    for k, r in enumerate(rows):
        d = doc(r)
        extra = {key: (vals[k % len(vals)] if isinstance(vals, list) else vals) for key, vals in fmt.items()}
        out.append(EvalPrompt(category, templates[k % len(templates)].format(doc=d, **extra), [r], [d]))
    return out


def chat(p: Picker) -> list[EvalPrompt]:
    out = plain("chat", p.by_id(ARENA_FILE, ARENA["chat"]) + p.by_id(SEED_FILE, SEEDS["chat"]))
    out += wrap("chat", [
        "My kid brought this homework problem home and we're both stuck. Could you walk us through how to "
        "think about it, without just handing us the answer?\n\n{doc}",
        "I'm helping a friend who gets anxious about maths. How would you explain this problem to her "
        "in a calm, encouraging way?\n\n{doc}",
    ], p.take(GSM8K, 4), lambda r: r.prompt)
    out += wrap("chat", [
        "I just started learning to program and my mentor gave me this exercise: \"{doc}\" I'm a bit "
        "overwhelmed. How should I approach it before writing any code?",
        "Beginner here. Our teacher asked us to do this: \"{doc}\" Which language would you pick for it, "
        "and what should I learn first?",
    ], p.take(CODE, 3, is_single_line), lambda r: r.prompt.strip())
    return out


def qa(p: Picker) -> list[EvalPrompt]:
    rows = p.by_id(ARENA_FILE, ARENA["qa"]) + p.take(CODE, 17, lambda r: bool(CODE_QUESTION.match(r.prompt)))
    return plain("qa", rows)


def math(p: Picker) -> list[EvalPrompt]:
    rows = p.take(GSM8K, 18) + p.by_id(ARENA_FILE, ARENA["math"]) + p.by_id(SEED_FILE, SEEDS["math"])
    return plain("math", rows)


def code(p: Picker) -> list[EvalPrompt]:
    out = plain("code", p.by_id(ARENA_FILE, ARENA["code"]))
    out += plain("code", p.take(CODE, 8, lambda r: not CODE_QUESTION.match(r.prompt)))
    # code editing: the answer comes back nearly unchanged, the draft can copy it
    out += wrap("code", [
        "Add a short comment above every function in the code below. Change nothing else and return the "
        "whole file.\n\n{doc}",
        "Rename the variables in this code to longer, more descriptive names, keeping the logic exactly the "
        "same. Show the complete result.\n\n{doc}",
        "{doc}\n\nRewrite the code above so that it checks its inputs and fails with a clear message on "
        "invalid ones. Give the full updated version.",
        "Reformat this code with four-space indentation and consistent spacing, without changing what it "
        "does:\n\n{doc}",
        "Insert a log or print statement at the start of each function in this code and return all of "
        "it:\n\n{doc}",
        "Refactor the following so that the main logic lives in its own function, and show the entire "
        "program afterwards.\n\n{doc}",
    ], p.take(CODE, 6, is_code_document), lambda r: fenced(r.answer))
    return out


def summarization(p: Picker) -> list[EvalPrompt]:
    out = plain("summarization", p.by_id(ARENA_FILE, ARENA["summarization"]))
    [deck] = p.by_id(ARENA_FILE, [ARENA_DOCS["summarization"]])
    d = clip(deck.prompt)
    out.append(EvalPrompt("summarization", "A user sent the request below. Summarize what they want built as a "
                          f"numbered list of requirements, so a colleague can pick it up.\n\n---\n{d}\n---", [deck], [d]))
    [problem] = p.by_id(ARENA_FILE, [ARENA_DOCS["summarization_problem"]])
    d = problem.prompt
    out.append(EvalPrompt("summarization", f"{d}\n\nBefore answering anything: restate the problem above "
                          "briefly in your own words, keeping every input limit.", [problem], [d]))
    out += wrap("summarization", [
        "Below is a word problem followed by a worked solution.\n\n{doc}\n\nIn two or three sentences, "
        "explain in plain words what the solution does.",
        "Condense this worked example into a short note a student could put on a flashcard:\n\n{doc}",
        "TL;DR of the following, please:\n\n{doc}",
        "{doc}\n\nWhat is the key idea of this solution? One short paragraph.",
    ], p.take(GSM8K, 8), worked_example)
    # long documents: several worked examples in one prompt (up to ~1,500 tokens)
    for n in (3, 5, 6, 8):
        rows = p.take(GSM8K, n)
        docs = [worked_example(r) for r in rows]
        out.append(EvalPrompt("summarization", f"Here are {n} practice problems with their solutions.\n\n"
                              f"{numbered(docs)}\n\nWrite one line per problem saying what it asks and what "
                              "the answer is.", rows, docs))
    out += wrap("summarization", [
        "What does this code do? Describe it in a short paragraph for someone who does not read code.\n\n{doc}",
        "Write a brief overview of the following source: its purpose, its functions, and what it prints or "
        "returns.\n\n{doc}",
        "{doc}\n\nSum up the code above in three sentences.",
    ], p.take(CODE, 4, is_code_document), lambda r: fenced(r.answer))
    for n in (3, 4):
        rows = p.take(CODE, n, is_code_document)
        docs = [fenced(r.answer) for r in rows]
        out.append(EvalPrompt("summarization", f"These {n} snippets come from one repository.\n\n{numbered(docs)}"
                              "\n\nGive a one-sentence description of each snippet.", rows, docs))
    return out


def first_words(text: str, n: int = 8) -> str:
    return " ".join(text.split()[:n])


def extraction(p: Picker) -> list[EvalPrompt]:
    out = plain("extraction", p.by_id(SEED_FILE, SEEDS["extraction"]))
    [table] = p.by_id(ARENA_FILE, [ARENA_DOCS["extraction"]])
    # the header and course rows alone: the totals below them are mostly empty cells, a token each
    lines = [line for line in table.prompt.splitlines() if ";" in line]
    d = "\n".join(itertools.takewhile(lambda line: not line.startswith(";"), lines))
    out.append(EvalPrompt("extraction", f"Here is part of a price list exported from a spreadsheet:\n\n{d}\n\n"
                          "Using only this table, list every course name with its gross price (bruttó ár), one "
                          "per line.", [table], [d]))
    # RAG: find the right document among several, then quote from it
    for k, n in enumerate((3, 4, 5, 6, 4, 7, 5, 8)):
        rows = p.take(GSM8K, n)
        docs = [worked_example(r) for r in rows]
        pick = (k * 3) % n
        if k % 2 == 0:
            question = (f"What final answer does the document whose problem begins \"{first_words(rows[pick].prompt)}"
                        "...\" arrive at? Quote the sentence of that document that states it.")
        else:
            question = (f"Which document is about \"{first_words(rows[pick].prompt, 6)}...\"? Copy its "
                        "problem statement word for word.")
        out.append(EvalPrompt("extraction", "Answer using only the documents below. If they do not contain "
                              f"the answer, say so.\n\n{numbered(docs)}\n\nQuestion: {question}", rows, docs))
    out += wrap("extraction", [
        "Read the passage and make a table with two columns, quantity and value, for every quantity it "
        "gives.\n\n{doc}",
        "From the text below, pull out every person, object and place it mentions, one per line, spelled "
        "exactly as written.\n\n{doc}",
        "{doc}\n\nCopy out, unchanged, the sentence of the text above that asks the actual question.",
    ], p.take(GSM8K, 6), lambda r: r.prompt)
    out += wrap("extraction", [
        "List the name of every function, class and variable defined in this code, one per line.\n\n{doc}",
        "Which libraries or headers does this code import or include? Quote those lines exactly.\n\n{doc}",
        "Return every string literal in this code, in order, as a JSON array.\n\n{doc}",
        "{doc}\n\nQuote, exactly as written, every line of the code above that calls a function.",
    ], p.take(CODE, 4, is_code_document), lambda r: fenced(r.answer))
    rows = p.take(CODE, 4, is_code_document)
    docs = [fenced(r.answer) for r in rows]
    out.append(EvalPrompt("extraction", f"Reference snippets:\n\n{numbered(docs)}\n\nUsing only these snippets: "
                          "which of them define a function with a loop in it? Quote each such function's first "
                          "line.", rows, docs))
    return out


def translation(p: Picker) -> list[EvalPrompt]:
    out = plain("translation", p.by_id(ARENA_FILE, ARENA["translation"]))
    out += wrap("translation", [
        "Translate this maths problem into French, keeping every number as it is.\n\n{doc}",
        "Please render the following in Spanish:\n\n{doc}",
        "Give me a German version of this text:\n\n{doc}",
        "Put this into Italian, sentence by sentence:\n\n{doc}",
        "Rewrite this word problem in the past tense and change nothing else:\n\n{doc}",
        "Rewrite the text below in British spelling and a formal register.\n\n{doc}",
        "Change every name in the following problem to a different name, keeping everything else word for "
        "word:\n\n{doc}",
        "{doc}\n\nRewrite the text above with every number written out in words.",
    ], p.take(GSM8K, 10), lambda r: r.prompt)
    out += wrap("translation", [
        "Rewrite the following solution as flowing prose without the arithmetic shorthand, keeping every "
        "number.\n\n{doc}",
        "Turn this worked solution into a numbered list of steps, wording each step as close to the "
        "original as you can:\n\n{doc}",
        "Convert this solution into the first person, as if the student were explaining their own work:\n\n{doc}",
    ], p.take(GSM8K, 3), lambda r: gsm8k_solution(r.answer))
    out += wrap("translation", [
        "Port this code to {lang}, keeping the same structure and names where you can.\n\n{doc}",
        "Translate the following program into {lang}:\n\n{doc}",
        "{doc}\n\nHow would the code above look in {lang}? Give the complete translation.",
    ], p.take(CODE, 6, is_code_document), lambda r: fenced(r.answer), lang=LANGUAGES)
    return out


BUILDERS = {"chat": chat, "qa": qa, "math": math, "code": code, "summarization": summarization,
            "extraction": extraction, "translation": translation}


def build(data_dir: Path) -> list[EvalPrompt]:
    picker = Picker(Path(data_dir))
    per_category = [BUILDERS[c](picker) for c in CATEGORIES]
    # round robin over the categories: the eval stage's `eval.limit: N` takes the first N rows,
    # which should be a mix, not N chat prompts
    return [p for rank in round_robin(per_category) for p in rank]


def to_records(prompts: list[EvalPrompt]) -> list[dict]:
    counters = dict.fromkeys(CATEGORIES, 0)
    out = []
    for p in prompts:
        counters[p.category] += 1
        out.append({"question_id": f"{p.category}-{counters[p.category]:03d}", "category": p.category,
                    "turns": [p.text], "source": ";".join(r.source for r in p.rows)})
    return out


def render(prompts: list[EvalPrompt]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in to_records(prompts))


def report(prompts: list[EvalPrompt], tokenizer_source: str | None) -> None:
    measure, unit = (len, "chars")
    if tokenizer_source:
        from specheads.target import load_tokenizer

        tok = load_tokenizer(tokenizer_source, require_chat_template=False)
        measure, unit = (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])), "tokens"
    lengths = {c: [measure(p.text) for p in prompts if p.category == c] for c in CATEGORIES}
    print(f"{'category':<14} {'prompts':>7}  {unit}: min / median / max")
    for c, ls in lengths.items():
        print(f"{c:<14} {len(ls):>7}  {min(ls)} / {int(statistics.median(ls))} / {max(ls)}")
    every = [x for ls in lengths.values() for x in ls]
    print(f"{'total':<14} {len(every):>7}  {min(every)} / {int(statistics.median(every))} / {max(every)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data"), help="the folder of the public prompt files")
    ap.add_argument("--out", type=Path, default=Path("specheads/assets/eval_mixed.jsonl"))
    ap.add_argument("--tokenizer", default="smollm2-135m", help="to report prompt lengths in tokens; 'none': characters")
    args = ap.parse_args(argv)
    prompts = build(args.data)
    args.out.write_text(render(prompts), encoding="utf-8")
    print(f"wrote {len(prompts)} prompts to {args.out}")
    report(prompts, None if args.tokenizer == "none" else args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
