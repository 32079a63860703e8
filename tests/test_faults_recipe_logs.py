"""Faults: numbers out of bounds in a recipe, corrupted append-only logs and metrics, eval touching a head.

1. Every count, size and rate of the recipe is bounded and checked on load, before anything loads: a bad value
   is a RecipeError (exit 2, one line) naming the key and the bound, NaN and inf included.
2. An append-only log (regenerated.jsonl, synthesized.jsonl) keeps every good row on resume, sets a bad line
   aside with its line number and says so; only a torn last line is dropped, and that is said too. A
   metrics.jsonl reader skips a torn last line and names a bad one instead of failing.
3. ``specheads eval`` leaves the head directory it evaluates byte-identical unless ``--update-card`` is given.
"""
import json
import logging
from pathlib import Path

import pytest

from specheads.cli import main
from specheads.config import Recipe, RecipeError, load_recipe
from specheads.data.appendlog import bad_path, read_rows

RECIPE = "recipes/smollm2_eagle3.yaml"


# ---------------------------------------------------------------- 1. bounds of the recipe's numbers
BAD_VALUES = [
    # (override, key named, bound named)
    ("train.lr=-1e-3", "train.lr", "greater than 0"),
    ("train.lr=0", "train.lr", "greater than 0"),
    ("train.max_steps=-3", "train.max_steps", "greater than or equal to 1"),
    ("train.max_steps=0", "train.max_steps", "greater than or equal to 1"),
    ("train.epochs=-1", "train.epochs", "greater than 0"),
    ("train.epochs=0", "train.epochs", "greater than 0"),
    ("vocab.draft_vocab_size=0", "vocab.draft_vocab_size", "greater than or equal to 1"),
    ("data.sources.0.limit=-5", "data.sources.0.limit", "greater than or equal to 1"),
    ("data.sources.0.limit=0", "data.sources.0.limit", "greater than or equal to 1"),
    ("train.micro_batch_size=0", "train.micro_batch_size", "greater than or equal to 1"),
    ("train.grad_accum=0", "train.grad_accum", "greater than or equal to 1"),
    ("train.warmup_steps=-1", "train.warmup_steps", "greater than or equal to 0"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio", "less than or equal to 1"),
    ("train.weight_decay=-0.1", "train.weight_decay", "greater than or equal to 0"),
    ("train.grad_clip=-1", "train.grad_clip", "greater than or equal to 0"),
    ("train.betas=[0.9,1.0]", "train.betas.1", "less than 1"),
    ("train.loss_decay=0", "train.loss_decay", "greater than 0"),
    ("train.save_every=-1", "train.save_every", "greater than or equal to 0"),
    ("train.logging.every=0", "train.logging.every", "greater than or equal to 1"),
    ("train.num_workers=-1", "train.num_workers", "greater than or equal to 0"),
    ("data.max_length=0", "data.max_length", "greater than or equal to 1"),
    ("data.regenerate.max_new_tokens=0", "data.regenerate.max_new_tokens", "greater than or equal to 1"),
    ("data.regenerate.batch_size=0", "data.regenerate.batch_size", "greater than or equal to 1"),
    ("data.regenerate.temperature=-0.5", "data.regenerate.temperature", "greater than or equal to 0"),
    ("data.regenerate.top_p=0", "data.regenerate.top_p", "greater than 0"),
    ("data.synthesize.batch_size=0", "data.synthesize.batch_size", "greater than or equal to 1"),
    ("dump.batch_tokens=0", "dump.batch_tokens", "greater than or equal to 1"),
    ("dump.shard_tokens=-1", "dump.shard_tokens", "greater than or equal to 1"),
    ("head.num_layers=0", "head.num_layers", "greater than or equal to 1"),
    ("head.lora.r=0", "head.lora.r", "greater than or equal to 1"),
    ("head.lora.dropout=1", "head.lora.dropout", "less than 1"),
    ("head.aux_layer_ids=[2,-1,20]", "head.aux_layer_ids.1", "greater than or equal to 0"),
    ("eval.limit=0", "eval.limit", "greater than or equal to 1"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens", "greater than or equal to 1"),
    ("eval.batch_size=0", "eval.batch_size", "greater than or equal to 1"),
    ("eval.top_p=1.5", "eval.top_p", "less than or equal to 1"),
    ("eval.chi_square_draws=-1", "eval.chi_square_draws", "greater than or equal to 0"),
    ("eval.thresholds=0.5,2", "eval.thresholds", "in [0, 1]"),
    ("seed=-1", "seed", "greater than or equal to 0"),
    # NaN and inf are refused wherever a float is read
    ("train.epochs=nan", "train.epochs", "finite"),
    ("train.epochs=.nan", "train.epochs", "finite"),
    ("train.lr=inf", "train.lr", "finite"),
    ("train.lr=.inf", "train.lr", "finite"),
    ("train.grad_clip=.nan", "train.grad_clip", "finite"),
    ("eval.temperature=inf", "eval.temperature", "finite"),
    ("data.synthesize.categories.chat.weight=.inf", "data.synthesize.categories.chat.weight", "finite"),
    ("eval.thresholds=0.5,nan", "eval.thresholds", "in [0, 1]"),
]


@pytest.mark.parametrize("override,key,bound", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_number_out_of_bounds_is_refused_before_anything_loads(override, key, bound, capsys):
    assert main(["train", RECIPE, override, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "command line" in err and f" {key}: " in err and bound in err, err


def test_a_bad_number_in_the_file_is_blamed_on_the_file(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  micro_batch_size: 0\n")
    assert main(["train", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{p}: train.micro_batch_size: Input should be greater than or equal to 1" in err


def test_eval_flags_are_bounded_too(tmp_path, capsys):
    base = ["eval", "--target", "smollm2-135m", "--prompts", "builtin:demo_prompts", "--out", str(tmp_path),
            "--compare", "ngram", "--dry-run"]
    for flag, value, key in (("--limit", "0", "eval.limit"), ("--max-new-tokens", "-1", "eval.max_new_tokens"),
                             ("--batch-size", "0", "eval.batch_size"), ("--temperature", "nan", "eval.temperature")):
        assert main(base + [flag, value]) == 2
        assert key in capsys.readouterr().err


def test_defaults_and_the_shipped_recipes_stay_valid():
    Recipe()
    for p in sorted(Path("recipes").glob("*.yaml")):
        load_recipe(p)
    # values at the edge of a bound are allowed where they mean something
    r = load_recipe(RECIPE, ["train.warmup_steps=0", "train.grad_clip=0", "train.save_every=0", "train.eval_every=0",
                             "train.weight_decay=0", "train.min_lr_ratio=0", "train.min_lr_ratio=1", "eval.limit=null",
                             "vocab.draft_vocab_size=null", "train.max_steps=1", "train.epochs=0.5",
                             "data.regenerate.temperature=0", "eval.chi_square_draws=0"])
    assert r.train.epochs == 0.5 and r.eval.limit is None and r.vocab.draft_vocab_size is None
    with pytest.raises(RecipeError, match="max_chars .* must be >= data.synthesize.min_chars"):
        load_recipe(RECIPE, ["data.synthesize.min_chars=50", "data.synthesize.max_chars=10"])


# ---------------------------------------------------------------- 2. append-only logs
def _row(i: int) -> dict:
    return {"id": f"p{i}", "category": "chat", "messages": [{"role": "user", "content": f"q {i}"},
                                                            {"role": "assistant", "content": f"a {i}"}]}


def test_read_rows_keeps_every_good_row_and_sets_the_bad_ones_aside(tmp_path, capsys):
    out = tmp_path / "regenerated.jsonl"
    good = [json.dumps(_row(i)) for i in range(8)]
    lines = (good[:2] + ['{"id": "p9", "messages": [{"role": "us'] + good[2:5]  # line 3: cut mid-row
             + ['{"category": "chat"}']  # line 7: a JSON object without its id
             + good[5:8])
    torn = json.dumps(_row(8))[:25]
    out.write_text("\n".join(lines) + "\n" + torn)

    rows = read_rows(out, ("id", "messages"))
    assert rows == [_row(i) for i in range(8)]  # all 8 good rows, in order, also the 5 after the first bad line
    err = capsys.readouterr().err
    assert str(out) in err and "kept 8 good row(s)" in err
    assert "set aside 2 bad line(s) (line 3, 7" in err and str(bad_path(out)) in err
    assert "dropped a torn last line (line 11, 25 bytes" in err
    # the file holds the good rows alone, whole lines, ready for the next append
    assert out.read_text() == "".join(g + "\n" for g in good)
    aside = [json.loads(x) for x in bad_path(out).read_text().splitlines()]
    assert [(a["line"], a["file"]) for a in aside] == [(3, out.name), (7, out.name)]
    assert aside[0]["text"] == lines[2] and "not JSON" in aside[0]["reason"] and "'id'" in aside[1]["reason"]

    # a clean file is read as it is, silently; a second resume finds nothing more to set aside
    assert read_rows(out, ("id", "messages")) == rows
    assert capsys.readouterr().err == "" and len(bad_path(out).read_text().splitlines()) == 2


def test_read_rows_cuts_only_a_torn_tail_in_place(tmp_path, capsys):
    out = tmp_path / "synthesized.jsonl"
    out.write_text('{"id": "a", "turns": ["x"]}\n{"id": "b", "tu')
    assert read_rows(out, ("id", "turns")) == [{"id": "a", "turns": ["x"]}]
    assert out.read_text() == '{"id": "a", "turns": ["x"]}\n' and not bad_path(out).exists()
    assert "dropped a torn last line (line 2, 15 bytes" in capsys.readouterr().err
    # a whole last row that only lacks its newline is kept, and the newline added
    out.write_text('{"id": "a", "turns": ["x"]}\n{"id": "b", "turns": ["y"]}')
    assert [r["id"] for r in read_rows(out, ("id", "turns"))] == ["a", "b"]
    assert out.read_text().endswith('["y"]}\n')


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from specheads.target import load_target

    return load_target(str(tiny_target_dir))


def test_regenerate_resumes_past_a_corrupted_line_and_a_torn_one(tiny, tiny_target_dir, tmp_path, capsys):
    """Before: a bad line in the middle made the next `data regenerate` cut the file there, dropping every good
    conversation after it. Now the good ones are kept, the bad one is set aside, and the result equals an
    uninterrupted run."""
    from test_regenerate import _prompt_file, _recipe

    from specheads.data.regenerate import run_regenerate

    prompts = _prompt_file(tmp_path)
    run_regenerate(_recipe(tmp_path / "a", (tiny_target_dir, prompts)), target=tiny)
    ref = (tmp_path / "a/data/regenerated.jsonl").read_text().splitlines()
    assert len(ref) >= 8

    part = _recipe(tmp_path / "b", (tiny_target_dir, prompts))
    out = tmp_path / "b/data/regenerated.jsonl"
    out.parent.mkdir(parents=True)
    (tmp_path / "a/data/regenerated.jsonl.meta.json").replace(tmp_path / "b/data/regenerated.jsonl.meta.json")
    corrupted = ref[2][: len(ref[2]) // 2] + "\x00garbage"
    lines = ref[:2] + [corrupted] + ref[3:7]  # line 3 corrupted, 6 good conversations around it
    out.write_text("\n".join(lines) + "\n" + ref[7][:20])  # and a torn line 8
    capsys.readouterr()
    s = run_regenerate(part, target=tiny)
    assert s["already_done"] == 6  # every good conversation kept (before: 2)
    err = capsys.readouterr().err
    assert f"{out}: kept 6 good row(s); set aside 1 bad line(s) (line 3:" in err
    assert "dropped a torn last line (line 8, 20 bytes" in err
    aside = [json.loads(x) for x in bad_path(out).read_text().splitlines()]
    assert len(aside) == 1 and aside[0]["line"] == 3 and aside[0]["text"] == corrupted
    got = out.read_text().splitlines()
    assert sorted(got) == sorted(ref) and len({json.loads(x)["id"] for x in got}) == len(got)


def test_a_flipped_byte_inside_a_string_is_caught_by_the_line_checksum(tiny, tiny_target_dir, tmp_path, capsys):
    """Before: a flipped byte inside a JSON string still parsed, so the changed conversation was resumed past and
    trained on. Now each row carries its own checksum: `prepare` refuses the file naming the line, and the next
    `data regenerate` sets the line aside and generates that conversation again, equal to an uninterrupted run."""
    from test_regenerate import _prompt_file, _recipe

    from specheads.data.appendlog import LINE_CHECKSUM
    from specheads.data.formats import DataError, load_records
    from specheads.data.regenerate import run_regenerate

    recipe = _recipe(tmp_path / "a", (tiny_target_dir, _prompt_file(tmp_path)))
    run_regenerate(recipe, target=tiny)
    out = tmp_path / "a/data/regenerated.jsonl"
    ref = out.read_bytes()
    rows, _, _ = load_records(out)
    assert rows and all(LINE_CHECKSUM not in r for r in rows)  # readers never see the checksum

    lines = ref.split(b"\n")
    at = lines[3].index(b'"content": "') + len(b'"content": "')
    lines[3] = lines[3][:at] + bytes([lines[3][at] ^ 0x01]) + lines[3][at + 1:]  # still valid JSON
    json.loads(lines[3])
    out.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError) as e:
        load_records(out)
    assert e.value.row == 4 and e.value.field == LINE_CHECKSUM and "does not match its content" in str(e.value)

    # a flipped byte in the key itself leaves a row without a checksum in a file written with them: refused too
    lines[3] = json.dumps(json.loads(ref.split(b"\n")[3])).replace(LINE_CHECKSUM, "_sha2X6").encode()
    out.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match="written with one"):
        load_records(out)

    capsys.readouterr()
    s = run_regenerate(recipe, target=tiny)
    assert s["already_done"] == len(ref.splitlines()) - 1
    assert "set aside 1 bad line(s) (line 4:" in capsys.readouterr().err
    assert sorted(out.read_bytes().splitlines()) == sorted(ref.splitlines())


def test_metrics_readers_skip_a_torn_line_and_name_a_bad_one(tmp_path, caplog):
    from specheads.train.run_log import METRICS, RunLogger, plot_metrics, read_metrics

    rows = [{"split": "train", "step": s, "loss": 1.0 / s, "step_acc": [0.5], "sim_tau": 1.5} for s in range(1, 6)]
    text = [json.dumps(r) for r in rows]
    p = tmp_path / METRICS
    p.write_text("\n".join(text[:2] + ["{not json", "[1, 2]"] + text[2:]) + "\n" + '{"split": "tra')
    with caplog.at_level(logging.WARNING, logger="specheads.train"):
        assert read_metrics(tmp_path) == rows
    said = caplog.text
    assert str(p) in said and "skipped 2 bad line(s)" in said and "line 3, 4" in said
    assert "torn last line (line 8, 14 bytes" in said
    assert {q.name for q in plot_metrics(p, tmp_path / "plots")} == {"loss.png", "acc.png"}

    # a resumed run keeps the good rows up to its checkpoint, past the bad and torn lines
    recipe = load_recipe(RECIPE, ["train.logging.wandb=disabled"])
    logger = RunLogger(recipe, tmp_path, resume_step=3)
    logger.close(plot=False)
    assert read_metrics(p) == rows[:3]


# ---------------------------------------------------------------- 3. eval leaves the head alone
def _snapshot(d: Path) -> dict:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_eval_leaves_the_head_directory_byte_identical(tiny_target_dir, tmp_path):
    from test_eval import _export_random_head

    from specheads.formats.card import write_card

    head = _export_random_head(tmp_path / "h", hidden=64, target_hidden=64)
    write_card(head)  # as the export stage leaves it: a card without measured acceptance
    assert (head / "specheads.json").is_file() and "Measured acceptance" not in (head / "README.md").read_text()
    before = _snapshot(head)
    args = ["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--head", str(head),
            "--limit", "1", "--max-new-tokens", "4"]
    assert main(args + ["--out", str(tmp_path / "ev")]) == 0
    assert (tmp_path / "ev/report.json").is_file()
    assert _snapshot(head) == before  # no file changed, none added

    assert main(args + ["--out", str(tmp_path / "ev2"), "--update-card"]) == 0
    card = (head / "README.md").read_text()
    assert "Measured acceptance" in card and "From `report.json`" in card and str(tmp_path) not in card
    after = _snapshot(head)
    assert {k for k in after if after[k] != before.get(k)} <= {"README.md", "recipe.yaml"}


def test_update_card_is_a_recipe_key_and_a_flag(tmp_path):
    from test_eval import _recipe

    assert _recipe(tmp_path, "--compare", "ngram").eval.update_card is False
    assert _recipe(tmp_path, "--compare", "ngram", "--update-card").eval.update_card is True
    assert load_recipe(RECIPE, ["eval.update_card=true"]).eval.update_card is True


def test_an_error_in_a_multi_process_launch_names_its_rank(tmp_path, monkeypatch, capsys):
    """With several ranks, a fault (a full disk, say) is said by the rank that hit it, among the launcher's lines
    about the ranks it then stops: the line names that rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["train", str(tmp_path / "missing.yaml")]) != 0
    assert capsys.readouterr().err.startswith("specheads (rank 1 of 2): ")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", str(tmp_path / "missing.yaml")]) != 0
    assert capsys.readouterr().err.startswith("specheads: ")
