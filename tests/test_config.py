from pathlib import Path

import pytest

from specheads.config import RecipeError, load_recipe
from specheads.layer_ids import check_layer_ids, default_eagle3_layer_ids, hf_to_output_index, output_to_hf_index
from specheads.rundir import RunDir, recipe_hash

RECIPES = sorted(str(p.relative_to(Path(__file__).parents[1]))
                 for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def _named_kind(path: str) -> str:
    """The head kind a recipe's file name ends with: ..._eagle3.yaml, ..._peagle_gpu.yaml."""
    return Path(path).stem.removesuffix("_gpu").rsplit("_", 1)[-1]


def test_every_head_kind_has_a_shipped_recipe():
    assert {_named_kind(p) for p in RECIPES} >= {"eagle3", "peagle", "dflash"}


@pytest.mark.parametrize("path", RECIPES)
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert _named_kind(path) == r.head.kind, (path, r.head.kind)


def test_overrides_win_and_parse_types():
    r = load_recipe("recipes/smollm2_eagle3.yaml", ["train.lr=3e-4", "train.ttt_steps=5", "eval.compare=[ngram]",
                                                     "head.aux_layer_ids=[1,2,3]", "target.adapter=null"])
    assert r.train.lr == 3e-4 and r.train.ttt_steps == 5
    assert r.eval.compare == ["ngram"] and r.head.aux_layer_ids == [1, 2, 3] and r.target.adapter is None


def test_unknown_key_did_you_mean(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown recipe key 'train.lrr' — did you mean 'train.lr'\?"):
        load_recipe("recipes/smollm2_eagle3.yaml", ["train.lrr=1"])
    p = tmp_path / "r.yaml"
    p.write_text("taget:\n  source: x\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown recipe key 'taget' — did you mean 'target'"):
        load_recipe(p)


def test_bad_values_name_the_field():
    with pytest.raises(RecipeError, match=r"train.epochs"):
        load_recipe("recipes/smollm2_eagle3.yaml", ["train.epochs=abc"])
    with pytest.raises(RecipeError, match=r"eval.temperature"):
        load_recipe("recipes/smollm2_eagle3.yaml", ["eval.rule=rejection"])
    with pytest.raises(RecipeError, match="not key=value"):
        load_recipe("recipes/smollm2_eagle3.yaml", ["train.lr"])
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("recipes/nope.yaml")


def test_layer_id_convention():
    assert default_eagle3_layer_ids(30) == [2, 15, 27]
    assert default_eagle3_layer_ids(32) == [2, 16, 29]
    assert hf_to_output_index([2, 16, 29]) == [1, 15, 28]
    assert output_to_hf_index(hf_to_output_index([2, 16, 29])) == [2, 16, 29]
    with pytest.raises(ValueError, match=r"\[31\] out of range .* 30 decoder layers"):
        check_layer_ids([2, 15, 31], 30)


def test_recipe_hash_tracks_sections():
    a = load_recipe("recipes/smollm2_eagle3.yaml")
    b = load_recipe("recipes/smollm2_eagle3.yaml", ["eval.limit=3"])
    c = load_recipe("recipes/smollm2_eagle3.yaml", ["head.num_layers=2"])
    assert recipe_hash(a, "head", "train") == recipe_hash(b, "head", "train")
    assert recipe_hash(a, "head") != recipe_hash(c, "head")
    assert recipe_hash(a) != recipe_hash(b)


def test_run_dir_paths():
    r = load_recipe(None, ["run_dir=runs/x", "export.format=eagle"])
    d = RunDir(r)
    assert (d.rows, d.vocab, d.dump, d.train, d.export, d.eval) == (
        Path("runs/x/data/rows"), Path("runs/x/vocab"), Path("runs/x/dump"), Path("runs/x/train"),
        Path("runs/x/export/eagle"), Path("runs/x/eval"))
    assert (d.regenerated, d.synthesized) == (Path("runs/x/data/regenerated.jsonl"), Path("runs/x/data/synthesized.jsonl"))
    r.data.rows_dir, r.train.out, r.eval.out = "/r", "/t", "/e"  # a recipe key wins, read on each access
    assert (d.rows, d.train, d.eval, d.path("a", "b")) == (Path("/r"), Path("/t"), Path("/e"), Path("runs/x/a/b"))


def test_override_list_items():
    r = load_recipe("recipes/smollm2_eagle3.yaml", ["data.sources.0.limit=16"])
    assert r.data.sources[0].limit == 16
    with pytest.raises(RecipeError, match="not an index"):
        load_recipe("recipes/smollm2_eagle3.yaml", ["data.sources.5.limit=16"])
