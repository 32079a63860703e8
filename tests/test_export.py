"""Tests for specheads.formats and the export validation (tiny random heads, CPU)."""
import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.formats import ExportError, ExportMeta, convert, detect_format, load_any
from specheads.formats import card, eagle, mtp, sglang, speculators
from specheads.export import validate
from specheads.formats.common import load_tensors
from specheads.heads import Eagle1Head, Eagle3Head, HeadConfig, MTPHead

torch.set_num_threads(1)
H, I, NH, KV, VT, VD = 64, 96, 4, 2, 200, 128
META = ExportMeta(verifier_name_or_path="org/tiny-target", verifier_architectures=["LlamaForCausalLM"],
                  speculative_tokens=3, recipe={"lr": 1e-3}, data="tiny", training={"steps": 1})


def rnd(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_((1.0 if "norm" in n else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return m


def e3(**kw):
    base = dict(kind="eagle3", hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=KV,
                target_vocab_size=VT, draft_vocab_size=VD, aux_layer_ids=[2, 4, 6])
    base.update(kw)
    h = rnd(Eagle3Head(HeadConfig(**base)))
    if not h.cfg.full_vocab:
        sel = torch.randperm(VT, generator=torch.Generator().manual_seed(3))[:VD].sort().values
        h.set_vocab_mapping(sel - torch.arange(VD))
    return h.eval()


def e1():
    return rnd(Eagle1Head(HeadConfig(kind="eagle1", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                                     num_key_value_heads=KV, target_vocab_size=VT))).eval()


def mtph():
    return rnd(MTPHead(HeadConfig(kind="mtp", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                                  num_key_value_heads=KV, target_vocab_size=VT, num_mtp_depths=2,
                                  target_num_layers=2))).eval()


def names(d):
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def cfgj(d):
    return json.loads((Path(d) / "config.json").read_text())


def rewrite(d, fn):
    t = load_tensors(Path(d))
    fn(t)
    save_file(t, str(Path(d) / "model.safetensors"))


def edit_cfg(d, fn):
    c = cfgj(d)
    fn(c)
    (Path(d) / "config.json").write_text(json.dumps(c))


def assert_sd_equal(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    for k, v in sa.items():
        if k in skip:
            continue
        assert torch.equal(v, sb[k]), k


# ----------------------------------------------------------------- layouts
def test_speculators_layout_and_config(tmp_path):
    h = e3()
    speculators.save(h, META, tmp_path, dtype=torch.float32)
    assert names(tmp_path) == {
        "embed_tokens.weight", "fc.weight", "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
        "norm.weight", "lm_head.weight", "d2t", "t2d"}
    c = cfgj(tmp_path)
    assert "model_type" not in c
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["speculators_version"] == "0.9.0" and c["draft_vocab_size"] == VD
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert c[f] is False
    assert "target_hidden_size" in c and c["target_hidden_size"] is None
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    tl = c["transformer_layer_config"]
    assert tl["vocab_size"] == VT and tl["num_hidden_layers"] == 1 and tl["model_type"] == "llama"
    assert (tl["hidden_size"], tl["intermediate_size"], tl["num_attention_heads"], tl["num_key_value_heads"],
            tl["head_dim"]) == (H, I, NH, KV, 16)
    assert tl["rope_theta"] == 10000.0 and "rms_norm_eps" in tl and "max_position_embeddings" in tl
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    # full vocab: d2t / t2d omitted; qwen3-style head -> qwen3 layer config with q/k norms
    h2 = e3(draft_vocab_size=None, qk_norm=True, target_hidden_size=48)
    speculators.save(h2, META, tmp_path / "q")
    assert "d2t" not in names(tmp_path / "q") and "layers.0.self_attn.q_norm.weight" in names(tmp_path / "q")
    c2 = cfgj(tmp_path / "q")
    assert c2["transformer_layer_config"]["model_type"] == "qwen3" and c2["target_hidden_size"] == 48


def test_sglang_layout_and_config(tmp_path):
    h = e3()
    sglang.save(h, META, tmp_path)
    n = names(tmp_path)
    assert "embed_tokens.weight" not in n and not any(k.startswith("layers.") for k in n)
    assert {"midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "fc.weight", "d2t", "t2d"} <= n
    c = cfgj(tmp_path)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["vocab_size"] == VT and c["draft_vocab_size"] == VD
    assert c["tie_word_embeddings"] is False and "target_hidden_size" not in c
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]                 # vLLM: HF index
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # SGLang adds 1
    for bad in (dict(norm_before_residual=True), dict(qk_norm=True), dict(num_layers=2)):
        with pytest.raises(ExportError):
            sglang.save(e3(**bad), META, tmp_path / "bad")


def test_eagle1_layout(tmp_path):
    h = e1()
    eagle.save(h, META, tmp_path)
    n = names(tmp_path)
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight"} <= n
    assert "layers.0.input_layernorm.weight" not in n and "lm_head.weight" not in n
    c = cfgj(tmp_path)
    assert c["architectures"] == ["LlamaForCausalLMEagle"] and c["bias"] is True and c["num_hidden_layers"] == 1


# ----------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_eagle3_round_trip_bitwise(tmp_path, fmt):
    h = e3()
    mod = {"speculators": speculators, "sglang": sglang}[fmt]
    mod.save(h, META, tmp_path / "f32", dtype=torch.float32)
    h2, meta = mod.load(tmp_path / "f32")
    skip = ("embed_tokens.weight",) if fmt == "sglang" else ()
    assert_sd_equal(h, h2, skip)
    assert meta.verifier_name_or_path == "org/tiny-target" and meta.aux_layer_ids == [2, 4, 6]
    assert meta.speculative_tokens == 3 and meta.recipe_hash
    mod.save(h, META, tmp_path / "bf16")
    h3, _ = mod.load(tmp_path / "bf16", dtype=torch.bfloat16)
    assert_sd_equal(copy.deepcopy(h).to(torch.bfloat16), h3, skip)
    rep = validate.check(tmp_path / "bf16", reference_head=h, target_vocab_size=VT, verifier="org/tiny-target")
    assert rep.ok and 0 < rep.max_output_diff
    rep32 = validate.check(tmp_path / "f32", reference_head=h, dtype=torch.float32)
    assert rep32.max_output_diff < 1e-5


@pytest.mark.parametrize("src,dst", [("speculators", "sglang"), ("sglang", "speculators"),
                                     ("speculators", "speculators"), ("sglang", "sglang")])
def test_eagle3_convert_pairs(tmp_path, src, dst):
    h = e3()
    {"speculators": speculators, "sglang": sglang}[src].save(h, META, tmp_path / "a", dtype=torch.float32)
    assert detect_format(tmp_path / "a") == src
    convert(tmp_path / "a", dst, tmp_path / "b", dtype=torch.float32)
    h2, meta, fmt = load_any(tmp_path / "b")
    assert fmt == dst and meta.verifier_name_or_path == "org/tiny-target"
    skip = ("embed_tokens.weight",) if "sglang" in (src, dst) else ()
    assert_sd_equal(h, h2, skip)
    validate.check(tmp_path / "b", reference_head=h, atol=1e-5,
                   readers=("vllm",) if dst == "speculators" and "sglang" in (src,) else None)


def test_eagle1_and_mtp_round_trip(tmp_path):
    h = e1()
    eagle.save(h, META, tmp_path / "e", dtype=torch.float32)
    h2, _ = eagle.load(tmp_path / "e")
    assert_sd_equal(h, h2, skip=("lm_head.weight",))
    assert not bool(h2.lm_head.weight.any())  # the shared target lm_head is not exported
    validate.check(tmp_path / "e", reference_head=h, readers=("sglang",), atol=1e-5)
    m = mtph()
    mtp.save(m, META, tmp_path / "m", dtype=torch.float32)
    n = names(tmp_path / "m")
    assert {"model.layers.2.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.3.shared_head.norm.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight",
            "model.layers.2.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"} <= n
    assert cfgj(tmp_path / "m")["num_nextn_predict_layers"] == 2
    m2, _, fmt = load_any(tmp_path / "m")
    assert fmt == "mtp"
    assert_sd_equal(m, m2)
    validate.check(tmp_path / "m", reference_head=m, atol=1e-5)
    with pytest.raises(ExportError, match="EAGLE-3"):
        convert(tmp_path / "e", "speculators", tmp_path / "x")


def test_mtp_stitch_into_fake_deepseek(tmp_path):
    tdir = tmp_path / "target"
    tdir.mkdir()
    tc = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 2,
          "hidden_size": H, "vocab_size": VT, "num_nextn_predict_layers": 0}
    (tdir / "config.json").write_text(json.dumps(tc))
    tw = {f"model.layers.{i}.input_layernorm.weight": torch.ones(H) for i in range(2)}
    tw.update({"model.embed_tokens.weight": torch.randn(VT, H), "lm_head.weight": torch.randn(VT, H),
               "model.norm.weight": torch.ones(H)})
    save_file(tw, str(tdir / "model.safetensors"))
    (tdir / "tokenizer.json").write_text("{}")
    m = mtph()
    meta = ExportMeta(target_config=tc)
    mtp.save(m, meta, tmp_path / "mtp", dtype=torch.float32)
    out = mtp.stitch_into_target(tdir, tmp_path / "mtp", tmp_path / "stitched")
    c = cfgj(out)
    assert c["num_nextn_predict_layers"] == 2 and c["architectures"] == ["DeepseekV3ForCausalLM"]
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert idx["model.layers.3.eh_proj.weight"] == "model-mtp.safetensors"
    assert idx["model.layers.0.input_layernorm.weight"] == "model.safetensors"
    allt = load_tensors(out)
    assert torch.equal(allt["model.layers.2.eh_proj.weight"], m.layers[0].eh_proj.weight)
    assert torch.equal(allt["lm_head.weight"], tw["lm_head.weight"]) and (out / "tokenizer.json").is_file()
    with pytest.raises(ExportError, match="already has"):
        mtp.stitch_into_target(out, tmp_path / "mtp", tmp_path / "again")


# ----------------------------------------------------------------- validator catches
@pytest.fixture
def spec_dir(tmp_path):
    d = tmp_path / "spec"
    speculators.save(e3(), META, d)
    validate.check(d)
    return d


def test_catch_missing_tensor(spec_dir):
    rewrite(spec_dir, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(ExportError, match="missing tensor 'layers.0.mlp.up_proj.weight'"):
        validate.check(spec_dir)


def test_catch_misnamed_tensor(spec_dir):
    rewrite(spec_dir, lambda t: t.__setitem__("layers.0.mlp.upproj.weight", t.pop("layers.0.mlp.up_proj.weight")))
    with pytest.raises(ExportError, match="unexpected tensor 'layers.0.mlp.upproj.weight'"):
        validate.check(spec_dir)


def test_catch_missing_norm_flag(spec_dir):
    edit_cfg(spec_dir, lambda c: c.pop("norm_before_residual"))
    with pytest.raises(ExportError, match="norm flag 'norm_before_residual' is implicit"):
        validate.check(spec_dir)


def test_catch_wrong_shape(spec_dir):
    rewrite(spec_dir, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:-1].clone()))
    with pytest.raises(ExportError, match=r"tensor 'lm_head.weight' has shape \(127, 64\), expected \(128, 64\)"):
        validate.check(spec_dir)


def test_catch_missing_d2t(spec_dir):
    rewrite(spec_dir, lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(ExportError, match="missing tensor 'd2t'"):
        validate.check(spec_dir)


def test_catch_missing_aux_ids_and_model_type(spec_dir):
    edit_cfg(spec_dir, lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"), c.__setitem__("model_type", "llama")))
    with pytest.raises(ExportError) as e:
        validate.check(spec_dir)
    assert "eagle_aux_hidden_state_layer_ids" in str(e.value) and "model_type" in str(e.value)


def test_catch_wrong_dtype(spec_dir):
    rewrite(spec_dir, lambda t: t.__setitem__("norm.weight", t["norm.weight"].float()))
    with pytest.raises(ExportError, match="mixed float dtypes"):
        validate.check(spec_dir)
    rewrite(spec_dir, lambda t: t.__setitem__("d2t", t["d2t"].to(torch.int32)))
    with pytest.raises(ExportError, match="'d2t' has dtype I32"):
        validate.check(spec_dir, dtype=torch.bfloat16)


def test_catch_verifier_and_vocab_mismatch(spec_dir):
    with pytest.raises(ExportError, match="verifier name_or_path"):
        validate.check(spec_dir, verifier="org/other")
    with pytest.raises(ExportError, match="vocab_size 200 != target vocabulary 300"):
        validate.check(spec_dir, target_vocab_size=300)
    validate.check(spec_dir, verifier={"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]})


def test_catch_reference_mismatch(spec_dir):
    other = e3()
    with torch.no_grad():
        other.fc.weight.mul_(-1)
    with pytest.raises(ExportError, match="differ from the reference"):
        validate.check(spec_dir, reference_head=other)


def test_catch_speculators_reader_limits(tmp_path):
    speculators.save(e3(aux_layer_ids=[1, 2, 3, 4]), META, tmp_path)
    with pytest.raises(ExportError, match="3\\*hidden_size"):
        validate.check(tmp_path)
    validate.check(tmp_path, readers=("vllm",))


def test_catch_sglang_specific(tmp_path):
    d = tmp_path / "s"
    sglang.save(e3(), META, d)
    rewrite(d, lambda t: t.__setitem__("layers.0.hidden_norm.weight", t.pop("midlayer.hidden_norm.weight")))
    with pytest.raises(ExportError, match="must be named 'midlayer"):
        validate.check(d)
    d2 = tmp_path / "s2"
    sglang.save(e3(), META, d2)
    edit_cfg(d2, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(ExportError, match="off by one"):
        validate.check(d2)
    edit_cfg(d2, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 7]))
    with pytest.raises(ExportError, match="name different layers"):
        validate.check(d2)
    edit_cfg(d2, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 6], norm_before_residual=True))
    with pytest.raises(ExportError, match="ignored by SGLang"):
        validate.check(d2)


def test_catch_eagle1_fc_bias_for_vllm(tmp_path):
    eagle.save(e1(), META, tmp_path)
    with pytest.raises(ExportError, match="fc.bias"):
        validate.check(tmp_path)
    validate.check(tmp_path, readers=("sglang",))


def test_not_a_head_and_unknown_format(tmp_path):
    with pytest.raises(ExportError, match="no config.json"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ExportError, match="not a draft head"):
        load_any(tmp_path)
    speculators.save(e3(), META, tmp_path / "h")
    with pytest.raises(ExportError, match="unknown format 'gguf'"):
        convert(tmp_path / "h", "gguf", tmp_path / "o")
    with pytest.raises(ExportError, match="EAGLE-3"):
        speculators.save(e1(), META, tmp_path / "x")


def test_sglang_loader_reads_specforge_checkpoint(tmp_path):
    """SpecForge layout: midlayer.*, embed_tokens present, no layer ids, d2t only."""
    h = e3()
    sglang.save(h, META, tmp_path, dtype=torch.float32)
    (tmp_path / "specheads.json").unlink()
    edit_cfg(tmp_path, lambda c: [c.pop(k) for k in ("eagle_aux_hidden_state_layer_ids", "eagle_config",
                                                     "norm_before_residual", "norm_before_fc", "fc_norm",
                                                     "norm_output", "num_speculative_tokens")])
    rewrite(tmp_path, lambda t: (t.pop("t2d"), t.__setitem__("embed_tokens.weight", h.embed_tokens.weight.clone())))
    with pytest.raises(ExportError, match="eagle_aux_hidden_state_layer_ids"):
        sglang.load(tmp_path)
    h2, meta = sglang.load(tmp_path, target_num_layers=9)
    assert h2.cfg.aux_layer_ids == [2, 4, 6]
    assert_sd_equal(h, h2)


def test_card(tmp_path):
    speculators.save(e3(), META, tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"prompts": {"count": 4, "source": "p.jsonl"}, "runs": [
        {"name": "head k=3 greedy", "metrics": {"tau": 2.1, "vllm_mean_acceptance_length": 2.3, "acceptance_rate": 0.4,
                                                "alpha": [0.7, 0.5, 0.3]}, "speedup": 1.6,
         "lossless": {"kind": "greedy", "identical": 4, "total": 4}}]}))
    p = card.write_card(tmp_path, report_json=tmp_path / "report.json", model_path="DIR")
    text = p.read_text()
    assert ("vllm serve org/tiny-target --speculative-config "
            "'{\"method\":\"eagle3\",\"model\":\"DIR\",\"num_speculative_tokens\":3}'") in text
    assert ("python -m sglang.launch_server --model org/tiny-target --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path DIR --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4") in text
    assert "| head k=3 greedy | specheads | 2.10 | 2.30 | 0.40 | 0.70 0.50 0.30 | 1.60 | 4/4 identical |" in text
