"""Conversation and prompt loaders.

One entry point, :func:`load_conversations`, turns the usual public shapes of
chat / instruction data into one shape::

    {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}],
     "category": str | None}

Formats (``fmt``; ``"auto"`` looks at the keys of the first record):

``sharegpt``  ``{"conversations": [{"from", "value"}], "system"?}``; roles
              human/user -> user, gpt/assistant/chatgpt -> assistant, system.
``openai``    ``{"messages": [{"role", "content"}]}`` (alias ``messages``);
              ``developer`` is read as ``system``; content may be a string or
              a list of ``{"type": "text", "text"}`` parts.
``alpaca``    ``{"instruction", "input"?, "output"|"response"?}`` — the user
              turn is the instruction, then a blank line and the input when
              there is one. ``new_codealpaca`` carries both ``output`` and
              ``response``; ``output`` wins. Self-instruct seed tasks
              (``instances: [{"input", "output"}]``) give one conversation per
              instance (ids ``<id>#<k>`` when there is more than one).
``prompts``   plain prompt files (aliases ``prompt``, ``mtbench``): ``prompt``,
              ``question`` (an ``answer`` becomes an assistant turn, as in
              gsm8k), ``instruction`` without an output, or MT-Bench
              ``turns: [str]`` (user turns, no answers).

Files: JSON list, JSONL or Parquet, read through :mod:`datasets` (its Arrow
cache goes to a temporary directory, never to ``~/.cache``). When
``datasets`` cannot read a JSON file, it is read with :mod:`json` instead, so
a malformed line can be named.

Rules (checked while loading; the first problem raises :class:`DataError`
naming file, row, field):

- roles must be known; after an optional leading system message a
  conversation alternates user/assistant, starting with user;
- user content must be non-empty; an empty system message is dropped (format
  converters write ``"system": ""`` for "none"); an empty *final* assistant
  turn is dropped (the row becomes a prompt to be regenerated, with a logged
  warning); an empty assistant turn in the middle is an error;
- prompt-only records (no assistant turn) come back as conversations ending
  with a user turn. Multi-turn prompt-only records (MT-Bench ``turns``) carry
  their first user turn in ``messages`` and the later ones under
  ``"pending_turns"`` (they need answers before they can be sent);
  :func:`load_prompts` returns all turns of every record.

Ids come from ``id`` / ``uid`` / ``question_id`` / ``conversation_id`` when
present, else ``"<file stem>:<row>"``. ``category`` comes from the record's
``category`` field when present.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator

from specheads.errors import MissingInputError, SpecheadsError

from .appendlog import LINE_CHECKSUM, recorded_settings, verify_lines

log = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "FORMATS",
    "load_conversations",
    "load_prompts",
    "load_records",
    "detect_format",
    "resolve_data_path",
]

FORMATS = ("sharegpt", "openai", "alpaca", "prompts")
_FORMAT_ALIASES = {
    "sharegpt": "sharegpt",
    "openai": "openai",
    "messages": "openai",
    "chatml": "openai",
    "alpaca": "alpaca",
    "prompts": "prompts",
    "prompt": "prompts",
    "plain": "prompts",
    "mtbench": "prompts",
}

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ID_KEYS = ("id", "uid", "question_id", "conversation_id")
_ANSWER_KEYS = ("output", "response", "answer", "completion")


class DataError(SpecheadsError, ValueError):
    """A problem in an input data file, located by file, row and field."""

    def __init__(self, file: str | Path, row: int | None, field: str | None, msg: str, *, row_kind: str = "row"):
        self.file = str(file)
        self.row = row
        self.field = field
        self.msg = msg
        self.row_kind = row_kind
        where = self.file
        if row is not None:
            where += f", {row_kind} {row}"
        if field:
            where += f", field '{field}'"
        super().__init__(f"{where}: {msg}")


# --------------------------------------------------------------------------- reading

BUILTIN_PREFIX = "builtin:"


def resolve_data_path(path: str | Path) -> Path:
    """A data path; ``builtin:NAME`` names a file shipped in ``specheads/assets``
    (see :data:`specheads.data.sources.BUILTIN`)."""
    text = str(path)
    if text.startswith(BUILTIN_PREFIX):
        from .sources import resolve_source

        return resolve_source(text)
    return Path(path)


def _suffixes(path: Path) -> str:
    name = path.name.lower()
    for ext in (".jsonl", ".ndjson", ".json", ".parquet"):
        if name.endswith(ext):
            return ext
    return path.suffix.lower()


@contextlib.contextmanager
def quiet_datasets():
    """Silence datasets' progress bars and its logger while reading one file."""
    import datasets
    from datasets.utils import logging as ds_logging

    was_disabled = datasets.are_progress_bars_disabled()
    level = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    # datasets logs a parse failure at ERROR before raising; we raise our own error.
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    json_level = json_logger.level
    json_logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        json_logger.setLevel(json_level)
        ds_logging.set_verbosity(level)
        if not was_disabled:
            datasets.enable_progress_bars()


def _read_with_datasets(path: Path, kind: str) -> list[dict]:
    with quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="specheads-ds-") as cache:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=cache)
        return ds.to_list()


def _read_json_by_hand(path: Path, ext: str) -> tuple[list[dict], str]:
    """Read JSON / JSONL with :mod:`json`; name the first malformed line."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if ext == ".json" and stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(path, e.lineno, None, f"malformed JSON (line {e.lineno}, column {e.colno}): {e.msg}", row_kind="line") from None
        if not isinstance(data, list):
            raise DataError(path, None, None, "expected a JSON list of objects")
        # a plain list of prompt strings is a prompt file
        return [{"prompt": x} if isinstance(x, str) else x for x in data], "item"
    if ext == ".json" and stripped.startswith("{"):
        # a single JSON document holding one object, or a JSONL file named .json
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            if isinstance(data, dict):
                for key in ("data", "rows", "examples"):
                    if isinstance(data.get(key), list):
                        return data[key], "item"
                return [data], "item"
    rows: list[dict] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(path, lineno, None, f"malformed JSON line: {e.msg} (column {e.colno})", row_kind="line") from None
    return rows, "line"


def _is_list_of_strings(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[") and head[1:].lstrip().startswith(b'"')


def _jsonl_line_numbers(path: Path) -> list[int]:
    with open(path, encoding="utf-8") as f:
        return [i for i, line in enumerate(f, start=1) if line.strip()]


def load_records(path: str | Path) -> tuple[list[dict], list[int], str]:
    """Raw records of a data file, with the 1-based row number of each (line for
    JSONL, index for JSON lists and Parquet) and what that number counts. Rows that
    carry their own checksum (the generating stages' logs) are verified line by line
    and returned without it."""
    rows, numbers, kind = _load_records(path)
    path = resolve_data_path(path)
    if kind == "line" and (any(LINE_CHECKSUM in r for r in rows) or
                           (recorded_settings(path) or {}).get("line_checksums")):
        bad = verify_lines(path)
        if bad:
            (n, why), more = bad[0], len(bad) - 1
            raise DataError(path, n, LINE_CHECKSUM, why + (f" ({more} more line(s) like it)" if more else "") +
                            "; rerun the stage that wrote it (`specheads data regenerate` / `synthesize`): it sets "
                            "bad lines aside and generates those rows again", row_kind="line")
        for r in rows:
            r.pop(LINE_CHECKSUM, None)
    return rows, numbers, kind


def _load_records(path: str | Path) -> tuple[list[dict], list[int], str]:
    path = resolve_data_path(path)
    if not path.exists():
        raise MissingInputError(f"data file not found: {path}")
    if path.is_dir():
        raise DataError(path, None, None, "is a directory; give one data file")
    ext = _suffixes(path)
    if ext == ".parquet":
        try:
            rows = _read_with_datasets(path, "parquet")
        except Exception as e:  # noqa: BLE001 - report any reader failure as a data error
            raise DataError(path, None, None, f"cannot read Parquet file: {e}") from e
        return rows, list(range(1, len(rows) + 1)), "row"
    if ext not in (".json", ".jsonl", ".ndjson"):
        raise DataError(path, None, None, f"unknown file type '{ext}' (expected .json, .jsonl or .parquet)")
    try:
        if _is_list_of_strings(path):  # datasets would invent a 'text' column; these are prompts
            raise ValueError("a JSON list of strings")
        rows = _read_with_datasets(path, "json")
    except Exception as e:  # noqa: BLE001 - datasets failed: read by hand to locate the problem
        log.debug("datasets could not read %s (%s); reading it with json", path, e)
        rows, kind = _read_json_by_hand(path, ext)
        if kind == "line":
            numbers = _jsonl_line_numbers(path)
        else:
            numbers = list(range(1, len(rows) + 1))
        return rows, numbers, kind
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        return rows, list(range(1, len(rows) + 1)), "item"
    numbers = _jsonl_line_numbers(path)
    if len(numbers) != len(rows):  # e.g. a single pretty-printed object; fall back to indices
        numbers, kind = list(range(1, len(rows) + 1)), "item"
    else:
        kind = "line"
    return rows, numbers, kind


# --------------------------------------------------------------------------- parsing


def detect_format(record: dict) -> str:
    """Which of :data:`FORMATS` a record looks like."""
    if not isinstance(record, dict):
        raise ValueError("record is not a JSON object")
    if record.get("conversations") is not None:
        return "sharegpt"
    if record.get("messages") is not None:
        return "openai"
    if record.get("instruction") is not None and (
        record.get("instances") is not None or any(record.get(k) is not None for k in ("output", "response"))
    ):
        return "alpaca"
    if any(record.get(k) is not None for k in ("turns", "prompt", "question", "instruction")):
        return "prompts"
    keys = ", ".join(sorted(record)) or "none"
    raise ValueError(
        f"cannot tell the format from the keys ({keys}); expected 'conversations' (ShareGPT), 'messages' "
        "(OpenAI), 'instruction' (Alpaca) or 'prompt' / 'question' / 'turns' (plain prompts)"
    )


class _Row:
    """Context for errors about one record."""

    def __init__(self, path: Path, number: int, kind: str):
        self.path, self.number, self.kind = path, number, kind

    def error(self, field: str | None, msg: str) -> DataError:
        return DataError(self.path, self.number, field, msg, row_kind=self.kind)


def _text(row: _Row, value: Any, field: str, *, required: bool = True) -> str | None:
    if value is None:
        if required:
            raise row.error(field, "missing")
        return None
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for j, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise row.error(f"{field}[{j}]", f"unsupported content part of type '{ptype}' (only text is supported)")
        return "".join(parts)
    if not isinstance(value, str):
        raise row.error(field, f"expected a string, got {type(value).__name__}")
    return value


def _record_id(record: dict, row: _Row) -> str:
    for key in _ID_KEYS:
        value = record.get(key)
        if value is not None and str(value) != "":
            return str(value)
    return f"{row.path.stem}:{row.number}"


def _category(record: dict) -> str | None:
    value = record.get("category")
    if value is None or value == "":
        return None
    return str(value)


def _check_and_clean(messages: list[dict], row: _Row, fields: list[str]) -> list[dict]:
    """Drop empty system / trailing assistant turns; check roles alternate."""
    out: list[dict] = []
    out_fields: list[str] = []
    for m, field in zip(messages, fields):
        if m["role"] == "system" and not m["content"].strip():
            continue
        out.append(m)
        out_fields.append(field)
    if out and out[-1]["role"] == "assistant" and not out[-1]["content"].strip():
        log.warning("%s: empty final assistant turn dropped (%s %s); the row is now a prompt", row.path, row.kind, row.number)
        out.pop()
        out_fields.pop()
    if not out:
        raise row.error(None, "no messages")
    start = 0
    if out[0]["role"] == "system":
        start = 1
    for k in range(start, len(out)):
        m = out[k]
        want = "user" if (k - start) % 2 == 0 else "assistant"
        if m["role"] == "system":
            raise row.error(out_fields[k], "a system message is only allowed first")
        if m["role"] != want:
            prev = out[k - 1]["role"] if k > 0 else "start"
            raise row.error(
                out_fields[k],
                f"conversation does not alternate user/assistant: '{m['role']}' follows '{prev}' "
                "(expected an optional system message, then user, assistant, user, ...)",
            )
        if not m["content"].strip():
            what = "user" if m["role"] == "user" else "assistant (not final)"
            raise row.error(out_fields[k], f"empty {what} content")
    if len(out) == start:
        raise row.error(None, "only a system message, no user turn")
    return out


def _parse_sharegpt(record: dict, row: _Row) -> list[tuple[str, list[dict], dict]]:
    conv = record.get("conversations")
    if conv is None:
        raise row.error("conversations", "missing")
    if not isinstance(conv, list):
        raise row.error("conversations", f"expected a list, got {type(conv).__name__}")
    messages, fields = [], []
    system = record.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(row, system, "system")})
        fields.append("system")
    for j, turn in enumerate(conv):
        f = f"conversations[{j}]"
        if not isinstance(turn, dict):
            raise row.error(f, "expected an object with 'from' and 'value'")
        who = turn.get("from", turn.get("role"))
        if who is None:
            raise row.error(f"{f}.from", "missing")
        role = _SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            raise row.error(f"{f}.from", f"unknown role '{who}' (known: {', '.join(_SHAREGPT_ROLES)})")
        content = _text(row, turn.get("value", turn.get("content")), f"{f}.value")
        messages.append({"role": role, "content": content})
        fields.append(f"{f}.value")
    return [(_record_id(record, row), _check_and_clean(messages, row, fields), {})]


def _parse_openai(record: dict, row: _Row) -> list[tuple[str, list[dict], dict]]:
    msgs = record.get("messages")
    if msgs is None:
        raise row.error("messages", "missing")
    if not isinstance(msgs, list):
        raise row.error("messages", f"expected a list, got {type(msgs).__name__}")
    messages, fields = [], []
    for j, m in enumerate(msgs):
        f = f"messages[{j}]"
        if not isinstance(m, dict):
            raise row.error(f, "expected an object with 'role' and 'content'")
        who = m.get("role")
        if who is None:
            raise row.error(f"{f}.role", "missing")
        role = _OPENAI_ROLES.get(str(who).lower())
        if role is None:
            raise row.error(f"{f}.role", f"unknown role '{who}' (known: {', '.join(_OPENAI_ROLES)})")
        messages.append({"role": role, "content": _text(row, m.get("content"), f"{f}.content")})
        fields.append(f"{f}.content")
    return [(_record_id(record, row), _check_and_clean(messages, row, fields), {})]


def _user_from_instruction(row: _Row, instruction: Any, inp: Any, ifield: str, infield: str) -> str:
    text = _text(row, instruction, ifield)
    extra = _text(row, inp, infield, required=False)
    if extra is not None and extra.strip():
        text = f"{text}\n\n{extra}" if text.strip() else extra
    return text


def _parse_alpaca(record: dict, row: _Row) -> list[tuple[str, list[dict], dict]]:
    rid = _record_id(record, row)
    if record.get("instruction") is None:
        raise row.error("instruction", "missing")
    system = []
    if isinstance(record.get("system"), str) and record["system"].strip():
        system = [{"role": "system", "content": record["system"]}]
    instances = record.get("instances")
    if instances is not None:
        if not isinstance(instances, list) or not instances:
            raise row.error("instances", "expected a non-empty list of {input, output}")
        out = []
        for k, inst in enumerate(instances):
            f = f"instances[{k}]"
            if not isinstance(inst, dict):
                raise row.error(f, "expected an object with 'input' and 'output'")
            user = _user_from_instruction(row, record["instruction"], inst.get("input"), "instruction", f"{f}.input")
            answer = _text(row, inst.get("output"), f"{f}.output", required=False)
            msgs = system + [{"role": "user", "content": user}]
            fields = ["system"] * len(system) + ["instruction"]
            if answer is not None:
                msgs.append({"role": "assistant", "content": answer})
                fields.append(f"{f}.output")
            cid = rid if len(instances) == 1 else f"{rid}#{k}"
            out.append((cid, _check_and_clean(msgs, row, fields), {}))
        return out
    user = _user_from_instruction(row, record["instruction"], record.get("input"), "instruction", "input")
    msgs = system + [{"role": "user", "content": user}]
    fields = ["system"] * len(system) + ["instruction"]
    for key in ("output", "response"):
        if record.get(key) is not None:
            msgs.append({"role": "assistant", "content": _text(row, record[key], key)})
            fields.append(key)
            break
    return [(rid, _check_and_clean(msgs, row, fields), {})]


def _parse_prompts(record: dict, row: _Row) -> list[tuple[str, list[dict], dict]]:
    rid = _record_id(record, row)
    system = []
    if isinstance(record.get("system"), str) and record["system"].strip():
        system = [{"role": "system", "content": record["system"]}]
    turns = record.get("turns")
    if turns is not None:
        if isinstance(turns, str):
            turns = [turns]
        if not isinstance(turns, list) or not turns:
            raise row.error("turns", "expected a non-empty list of strings")
        texts = [_text(row, t, f"turns[{j}]") for j, t in enumerate(turns)]
        for j, t in enumerate(texts):
            if not t.strip():
                raise row.error(f"turns[{j}]", "empty user turn")
        msgs = _check_and_clean(system + [{"role": "user", "content": texts[0]}], row, ["system"] * len(system) + ["turns[0]"])
        extra = {"pending_turns": texts[1:]} if len(texts) > 1 else {}
        return [(rid, msgs, extra)]
    for key in ("prompt", "question", "instruction"):
        if record.get(key) is not None:
            if key == "instruction":
                user = _user_from_instruction(row, record[key], record.get("input"), key, "input")
            else:
                user = _text(row, record[key], key)
            msgs = system + [{"role": "user", "content": user}]
            fields = ["system"] * len(system) + [key]
            for akey in _ANSWER_KEYS:
                if record.get(akey) is not None:
                    msgs.append({"role": "assistant", "content": _text(row, record[akey], akey)})
                    fields.append(akey)
                    break
            return [(rid, _check_and_clean(msgs, row, fields), {})]
    raise row.error("prompt", "missing (a prompt record needs 'prompt', 'question', 'instruction' or 'turns')")


_PARSERS = {
    "sharegpt": _parse_sharegpt,
    "openai": _parse_openai,
    "alpaca": _parse_alpaca,
    "prompts": _parse_prompts,
}


def _iter_parsed(path: str | Path, fmt: str, skipped_empty: list | None = None
                 ) -> Iterator[tuple[str, list[dict], str | None, dict]]:
    path = resolve_data_path(path)
    key = _FORMAT_ALIASES.get(str(fmt).lower()) if fmt != "auto" else "auto"
    if key is None:
        raise ValueError(f"unknown data format '{fmt}' (expected auto or one of {', '.join(sorted(_FORMAT_ALIASES))})")
    records, numbers, kind = load_records(path)
    if not records:
        raise DataError(path, None, None, "no records")
    for record, number in zip(records, numbers):
        row = _Row(path, number, kind)
        if not isinstance(record, dict):
            raise row.error(None, f"expected a JSON object, got {type(record).__name__}")
        if key == "auto":
            try:
                rec_fmt = detect_format(record)
            except ValueError as e:
                raise row.error(None, str(e)) from None
        else:
            rec_fmt = key
        try:
            parsed = _PARSERS[rec_fmt](record, row)
        except DataError as e:
            # prompt files in the wild hold blank prompts: regeneration counts and skips them
            if skipped_empty is not None and "empty" in str(e) and "content" in str(e):
                skipped_empty.append(str(e))
                continue
            raise
        for cid, messages, extra in parsed:
            yield cid, messages, _category(record), extra


def load_conversations(path: str | Path, fmt: str = "auto") -> list[dict]:
    """Load a data file as conversations (see the module docstring)."""
    out = []
    for cid, messages, category, extra in _iter_parsed(path, fmt):
        conv = {"id": cid, "messages": messages, "category": category}
        conv.update(extra)
        out.append(conv)
    return out


def load_prompts(path: str | Path, fmt: str = "auto", skipped_empty: list | None = None) -> list[dict]:
    """Load a data file as prompts for regeneration / evaluation:
    ``{"id", "turns": [user texts], "category"}`` plus ``"system"`` when the
    record has a system message. Assistant turns present in the file are
    dropped (the target answers again). With ``skipped_empty`` (a list), rows
    with an empty prompt are skipped and their errors appended to it."""
    out = []
    for cid, messages, category, extra in _iter_parsed(path, fmt, skipped_empty):
        item: dict[str, Any] = {"id": cid, "turns": [m["content"] for m in messages if m["role"] == "user"], "category": category}
        item["turns"].extend(extra.get("pending_turns", []))
        if messages[0]["role"] == "system":
            item["system"] = messages[0]["content"]
        out.append(item)
    return out

