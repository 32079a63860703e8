"""P-EAGLE and DFlash in the speculators layout and the native DFlash layout (tiny random heads, CPU).

Reference values are speculators 0.9.0's (``PEagleSpeculatorConfig``, ``DFlashSpeculatorConfig``,
``DFlashDraftModel`` save rules) and vLLM 0.32's (``update_peagle``, ``update_dflash``,
``qwen3_dflash.load_weights``)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.export import validate
from specheads.formats import ExportError, ExportMeta, card, detect_format, dflash_native, load_any
from specheads.formats.convert import convert as convert_dir
from specheads.formats.convert import save as save_as
from specheads.formats import speculators
from specheads.formats.common import load_tensors
from specheads.heads import DFlashHead, HeadConfig, PEagleHead

torch.set_num_threads(1)
H, I, NH, KV, VT, VD, L = 32, 64, 4, 2, 160, 96, 8
META = ExportMeta(verifier_name_or_path="org/tiny-target", verifier_architectures=["LlamaForCausalLM"],
                  speculative_tokens=3)


def rnd(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_((1.0 if "norm" in n else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return m


def _vocab(h, vd):
    if vd < VT:
        sel = torch.randperm(VT, generator=torch.Generator().manual_seed(3))[:vd].sort().values
        h.set_vocab_mapping(sel - torch.arange(vd))
    return h.eval()


def peagle(vd=VD, **kw):
    base = dict(kind="peagle", hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=KV,
                target_vocab_size=VT, draft_vocab_size=vd, aux_layer_ids=[2, 4, 5], num_layers=2, num_depths=3,
                mask_token_id=7, target_num_layers=L)
    base.update(kw)
    return _vocab(rnd(PEagleHead(HeadConfig(**base))), vd)


def dflash(vd=VD, **kw):
    base = dict(kind="dflash", hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=KV,
                target_vocab_size=VT, draft_vocab_size=vd, aux_layer_ids=[1, 3, 5, 7], num_layers=2, block_size=4,
                mask_token_id=9, target_num_layers=L)
    base.update(kw)
    return _vocab(rnd(DFlashHead(HeadConfig(**base)), seed=1), vd)


def cfgj(d):
    return json.loads((Path(d) / "config.json").read_text())


def names(d):
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def edit(d, fn):
    c = cfgj(d)
    fn(c)
    (Path(d) / "config.json").write_text(json.dumps(c))


def drop_tensor(d, name):
    t = load_tensors(Path(d))
    t.pop(name)
    save_file(t, str(Path(d) / "model.safetensors"))


def inputs(cfg, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VT, (2, T), generator=g)
    aux = torch.randn(2, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    return ids, aux


def peagle_logits(h, ids, aux):
    T, K = ids.shape[1], h.cfg.num_depths
    anchor = torch.arange(T).repeat_interleave(K)[None].expand(2, -1)
    depth = torch.arange(K).repeat(T)[None].expand(2, -1)
    with torch.no_grad():
        return h.parallel_forward(ids, aux, anchor, depth)


def dflash_logits(h, ids, aux):
    with torch.no_grad():
        return h.block_forward_train(ids, aux, torch.tensor([[1, 5], [2, 6]]))


def fill_shared(loaded, ref):
    """What the target supplies on serving: the embedding and (full vocabulary) DFlash's lm_head."""
    with torch.no_grad():
        if not bool(loaded.embed_tokens.weight.any()):
            loaded.embed_tokens.weight.copy_(ref.embed_tokens.weight)
        if isinstance(loaded, DFlashHead) and not bool(loaded.lm_head.weight.any()):
            loaded.lm_head.weight.copy_(ref.lm_head.weight)
    return loaded


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ------------------------------------------------------------------ P-EAGLE
def test_peagle_round_trip_and_config(tmp_path):
    h = peagle()
    out = speculators.save(h, META, tmp_path / "p", dtype=torch.float32)
    c = cfgj(out)
    assert c["speculators_model_type"] == "peagle" and c["architectures"] == ["PEagleSpeculator"]
    assert "model_type" not in c
    assert c["mask_token_id"] == 7 and c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert {f: c[f] for f in speculators.NORM_FLAGS} == dict.fromkeys(speculators.NORM_FLAGS, False)
    assert c["transformer_layer_config"]["num_hidden_layers"] == 2
    sc = c["speculators_config"]
    assert sc["algorithm"] == "peagle" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert c["draft_vocab_size"] == VD
    assert {"mask_hidden", "fc.weight", "layers.0.hidden_norm.weight", "layers.1.mlp.up_proj.weight", "d2t", "t2d",
            "embed_tokens.weight", "lm_head.weight"} <= names(out)
    assert detect_format(out) == "speculators"
    back, meta = load_any(out)[:2]
    assert isinstance(back, PEagleHead) and back.cfg.num_depths == 3 and back.cfg.mask_token_id == 7
    assert back.cfg.norm_before_residual is False and meta.speculative_tokens == 3
    assert_same_state(h, back)
    ids, aux = inputs(h.cfg)
    assert torch.equal(peagle_logits(h, ids, aux), peagle_logits(back.eval(), ids, aux))
    rep = validate.check(out, reference_head=h, target_vocab_size=VT, atol=1e-5)
    assert rep.ok and rep.max_output_diff == 0.0


def test_peagle_missing_norm_before_residual_reads_false_like_vllm(tmp_path):
    out = speculators.save(peagle(), META, tmp_path / "p", dtype=torch.float32)
    edit(out, lambda c: c.pop("norm_before_residual"))
    assert load_any(out)[0].cfg.norm_before_residual is False  # vLLM update_peagle: default False


def test_peagle_refusals(tmp_path):
    h = peagle()
    del h.mask_hidden
    with pytest.raises(ExportError, match="mask_hidden"):
        speculators.save(h, META, tmp_path / "a", dtype=torch.float32)
    for flag in ("fc_norm", "norm_output"):
        with pytest.raises(ExportError, match="fc_norm/norm_output"):
            speculators.save(peagle(**{flag: True}), META, tmp_path / flag, dtype=torch.float32)
    h = peagle()
    h.cfg.mask_token_id = None
    with pytest.raises(ExportError, match="mask_token_id"):
        speculators.save(h, META, tmp_path / "b", dtype=torch.float32)
    out = speculators.save(peagle(), META, tmp_path / "c", dtype=torch.float32)
    drop_tensor(out, "mask_hidden")
    with pytest.raises(ExportError, match=r"model\.safetensors|mask_hidden") as e:
        load_any(out)
    assert str(out) in str(e.value) and "mask_hidden" in str(e.value)
    assert not validate.check(out, raise_on_error=False).ok
    out = speculators.save(peagle(), META, tmp_path / "d", dtype=torch.float32)
    edit(out, lambda c: c.pop("mask_token_id"))
    with pytest.raises(ExportError, match=r"config\.json: missing field 'mask_token_id'"):
        load_any(out)
    out = speculators.save(peagle(), META, tmp_path / "e", dtype=torch.float32)
    edit(out, lambda c: c.update(fc_norm=True))
    with pytest.raises(ExportError, match="fc_norm"):
        load_any(out)


@pytest.mark.parametrize("fmt", ["sglang", "eagle", "mtp", "dflash_native"])
def test_peagle_other_formats_refused(tmp_path, fmt):
    with pytest.raises(ExportError, match=f"a peagle head cannot be written as '{fmt}'"):
        save_as(peagle(), META, tmp_path / fmt, fmt, dtype=torch.float32)


# ------------------------------------------------------------------ DFlash (speculators)
@pytest.mark.parametrize("vd", [VD, VT])
def test_dflash_round_trip_and_config(tmp_path, vd):
    h = dflash(vd)
    out = speculators.save(h, META, tmp_path / "d", dtype=torch.float32)
    c = cfgj(out)
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashSpeculator"]
    assert "model_type" not in c
    assert c["block_size"] == 4 and c["aux_hidden_state_layer_ids"] == [1, 3, 5, 7] and c["mask_token_id"] == 9
    assert c["draft_vocab_size"] == vd and c["target_hidden_size"] is None and c["sample_from_anchor"] is False
    assert c["sliding_window_non_causal"] is True  # vLLM 0.32: dflash_config.causal = not this, for every layer
    tl = c["transformer_layer_config"]
    assert tl["num_hidden_layers"] == 2 and tl["model_type"] == "qwen3"
    sc = c["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    n = names(out)
    assert "embed_tokens.weight" not in n and "mask_hidden" not in n
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= n
    assert ("lm_head.weight" in n) == ("d2t" in n) == ("t2d" in n) == (vd < VT)  # speculators' save rule
    back, meta = load_any(out)[:2]
    assert isinstance(back, DFlashHead) and back.cfg.block_size == 4 and meta.speculative_tokens == 3
    fill_shared(back, h)
    assert_same_state(h, back)
    ids, aux = inputs(h.cfg)
    assert torch.equal(dflash_logits(h, ids, aux), dflash_logits(back.eval(), ids, aux))
    rep = validate.check(out, reference_head=h, target_vocab_size=VT, atol=1e-5)
    assert rep.ok and rep.max_output_diff == 0.0, str(rep)


def test_dflash_bf16_export_validates(tmp_path):
    h = dflash()
    out = speculators.save(h, META, tmp_path / "d", dtype=torch.bfloat16)
    rep = validate.check(out, reference_head=h, target_vocab_size=VT, dtype=torch.bfloat16)
    assert rep.ok and rep.max_output_diff is not None


def test_dflash_refusals(tmp_path):
    h = dflash()
    h.cfg.mask_token_id = None
    with pytest.raises(ExportError, match="mask_token_id"):
        speculators.save(h, META, tmp_path / "a", dtype=torch.float32)
    out = speculators.save(dflash(), META, tmp_path / "b", dtype=torch.float32)
    edit(out, lambda c: c.pop("mask_token_id"))
    with pytest.raises(ExportError, match=r"config\.json: missing field 'mask_token_id'"):
        load_any(out)
    out = speculators.save(dflash(), META, tmp_path / "c", dtype=torch.float32)
    t = load_tensors(out)
    t["mask_hidden"] = torch.zeros(1, 1, 4 * H)
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="mask_hidden"):
        load_any(out)
    rep = validate.check(out, raise_on_error=False)
    assert any("mask_hidden" in e for e in rep.errors)
    out = speculators.save(dflash(), META, tmp_path / "d", dtype=torch.float32)
    edit(out, lambda c: c.update(sliding_window_non_causal=False))
    assert any("causally" in e for e in validate.check(out, raise_on_error=False).errors)
    out = speculators.save(dflash(), META, tmp_path / "e", dtype=torch.float32)
    drop_tensor(out, "d2t")
    assert any("'d2t'" in e for e in validate.check(out, raise_on_error=False).errors)


@pytest.mark.parametrize("fmt", ["sglang", "eagle", "mtp"])
def test_dflash_other_formats_refused(tmp_path, fmt):
    with pytest.raises(ExportError, match=f"a dflash head cannot be written as '{fmt}'"):
        save_as(dflash(), META, tmp_path / fmt, fmt, dtype=torch.float32)


# ------------------------------------------------------------------ DFlash (native)
@pytest.mark.parametrize("vd", [VD, VT])
def test_dflash_native_round_trip_and_layer_ids(tmp_path, vd):
    h = dflash(vd)
    out = dflash_native.save(h, META, tmp_path / "n", dtype=torch.float32)
    c = cfgj(out)
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"mask_token_id": 9, "target_layer_ids": [0, 2, 4, 6]}  # HF index - 1
    assert c["block_size"] == 4 and c["num_target_layers"] == L and c["num_hidden_layers"] == 2
    assert ("draft_vocab_size" in c) == (vd < VT)
    assert "embed_tokens.weight" not in names(out) and ("lm_head.weight" in names(out)) == (vd < VT)
    assert detect_format(out) == "dflash_native"
    back = fill_shared(load_any(out)[0], h)
    assert back.cfg.aux_layer_ids == [1, 3, 5, 7]
    assert_same_state(h, back)
    ids, aux = inputs(h.cfg)
    assert torch.equal(dflash_logits(h, ids, aux), dflash_logits(back.eval(), ids, aux))
    assert validate.check(out, reference_head=h, target_vocab_size=VT, atol=1e-5).ok
    # speculators <-> native convert both ways with the same weights
    spec = convert_dir(out, "speculators", tmp_path / "s", dtype=torch.float32)
    assert cfgj(spec)["aux_hidden_state_layer_ids"] == [1, 3, 5, 7]
    assert_same_state(h, fill_shared(load_any(spec)[0], h))


def _foreign(tmp_path, **cfg_changes):
    """A native checkpoint as published (no specheads side file)."""
    out = dflash_native.save(dflash(VT), META, tmp_path / "z", dtype=torch.float32)
    (out / "specheads.json").unlink()
    edit(out, lambda c: c.update(cfg_changes))
    return out


def test_dflash_native_import_records_provenance(tmp_path):
    out = _foreign(tmp_path)
    head, meta = dflash_native.load(out)
    src = meta.training["imported_from"]
    assert src["format"] == "dflash_native" and src["path"] == str(out.resolve())
    assert src["dflash_config"]["target_layer_ids"] == [0, 2, 4, 6] and src["num_target_layers"] == L
    assert src["embedding_shared"] and src["lm_head_shared"]
    assert meta.target_config == {"num_hidden_layers": L, "hidden_size": H, "vocab_size": VT}
    assert head.cfg.target_num_layers == L
    ident = {"hidden_size": H, "vocab_size": VT, "num_layers": L}
    dflash_native.load(out, target=ident)  # fits


@pytest.mark.parametrize("ident, what", [
    ({"hidden_size": 2 * H, "vocab_size": VT, "num_layers": L}, "hidden size"),
    ({"hidden_size": H, "vocab_size": VT + 1, "num_layers": L}, "vocab"),
    ({"hidden_size": H, "vocab_size": VT, "num_layers": 12}, "num_target_layers 8 != target's 12"),
    ({"hidden_size": H, "vocab_size": VT, "num_layers": 4}, "out of range"),
])
def test_dflash_native_for_another_target_refused(tmp_path, ident, what):
    out = _foreign(tmp_path)
    with pytest.raises(ExportError, match="made for another target") as e:
        dflash_native.load(out, target=ident)
    assert what in str(e.value) and str(out) in str(e.value)


def test_dflash_native_refusals(tmp_path):
    with pytest.raises(ExportError, match="aux_layer_ids include 0"):
        dflash_native.save(dflash(aux_layer_ids=[0, 3]), META, tmp_path / "a", dtype=torch.float32)
    h = dflash(target_num_layers=None)
    with pytest.raises(ExportError, match="num_target_layers"):
        dflash_native.save(h, META, tmp_path / "b", dtype=torch.float32)
    out = _foreign(tmp_path / "c")
    edit(out, lambda c: c["dflash_config"].pop("mask_token_id"))
    with pytest.raises(ExportError, match=r"config\.json: missing field 'dflash_config.mask_token_id'"):
        load_any(out)
    out = _foreign(tmp_path / "d", num_target_layers=6)
    assert any("out of range for 6 target layers" in e for e in validate.check(out, raise_on_error=False).errors)


# ------------------------------------------------------------------ the export stage and the card
@pytest.mark.parametrize("make, kind", [(peagle, "peagle"), (dflash, "dflash")])
def test_cli_export_writes_and_validates(tmp_path, make, kind):
    from interop import tiny
    from specheads.cli import main

    head = make(vd=tiny.VT, hidden_size=tiny.H, intermediate_size=tiny.I, target_vocab_size=tiny.VT)
    run = tiny.fake_run(tmp_path / "run", head)
    out = tmp_path / "exp"
    assert main(["export", str(run), "--format", "speculators", "--out", str(out), "--dtype", "float32"]) == 0
    assert cfgj(out)["speculators_model_type"] == kind
    side = json.loads((out / "specheads.json").read_text())
    assert side["meta"]["speculative_tokens"] == head.cfg.tokens_per_forward == 3
    readme = (out / "README.md").read_text()
    if kind == "peagle":
        assert '"method":"eagle3"' in readme and '"parallel_drafting":true' in readme
        assert '"num_speculative_tokens":3' in readme and "K = 3" in readme
    else:
        assert '"method":"dflash"' in readme and '"num_speculative_tokens":3' in readme and "block of 4" in readme
    assert "SGLang has no reader" in readme
    assert main(["export", str(run), "--format", "sglang", "--out", str(tmp_path / "sg")]) != 0


def test_launch_lines():
    p = card.launch_lines("t", "d", 5, "speculators", "peagle")
    assert json.loads(p["vllm"].split("'")[1]) == {"method": "eagle3", "model": "d", "num_speculative_tokens": 5,
                                                   "parallel_drafting": True}
    assert p["sglang"] is None
    f = card.launch_lines("t", "d", 7, "speculators", "dflash")
    assert json.loads(f["vllm"].split("'")[1]) == {"method": "dflash", "model": "d", "num_speculative_tokens": 7}
    assert card.launch_lines("t", "d", 3) == card.launch_lines("t", "d", 3, "speculators", "eagle3")
