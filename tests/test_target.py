import json

import pytest
import torch

from specheads.target import TargetError, load_target

pytestmark = pytest.mark.slow


def test_bundled_gguf_facts(smollm2):
    t = smollm2
    assert (t.num_layers, t.hidden_size, t.vocab_size, t.model_type) == (30, 576, 49152, "llama")
    assert t.aux_layer_ids() == [2, 15, 27]
    assert t.tokenizer.chat_template and "<|im_start|>" in t.tokenizer.chat_template
    assert len(t.config_hash) == 16 and t.identity()["name"] == "smollm2-135m"
    assert not any(p.requires_grad for p in t.model.parameters())


def test_aux_states_equal_output_hidden_states(smollm2):
    t = smollm2
    ids = t.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    ref = t.model(ids, output_hidden_states=True).hidden_states
    for layer_ids in ([2, 15, 27], [0, 1, 30]):
        aux, final = t.hidden_states(ids, aux_layer_ids=layer_ids)
        H = t.hidden_size
        for j, i in enumerate(layer_ids):
            torch.testing.assert_close(aux[..., j * H:(j + 1) * H], ref[i], rtol=0, atol=0)
        torch.testing.assert_close(final, ref[-1], rtol=0, atol=0)
    # padded batch: the attention mask keeps the real tokens' states unchanged
    ids2 = torch.cat([ids, torch.full((1, 3), t.tokenizer.pad_token_id)], 1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=ids.dtype)], 1)
    aux2, _ = t.hidden_states(ids2, attention_mask=mask)
    aux1, _ = t.hidden_states(ids)
    torch.testing.assert_close(aux2[:, : ids.shape[1]], aux1, rtol=1e-4, atol=1e-4)


def test_layer_id_out_of_range(smollm2):
    with pytest.raises(ValueError, match=r"\[31\] out of range"):
        smollm2.hidden_states(torch.tensor([[1, 2]]), aux_layer_ids=[2, 31])


def test_fine_tuned_target_has_another_identity(smollm2, tmp_path):
    """A PEFT LoRA adapter merged into the target changes its identity (and its states)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(base_dir)
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")

    plain = load_target(str(base_dir))
    adapted = load_target(str(base_dir), adapter=str(tmp_path / "adapter"))
    assert plain.config_hash != adapted.config_hash
    ids = torch.tensor([[1, 1, 1, 1]])
    a1, _ = plain.hidden_states(ids, aux_layer_ids=[2])
    a2, _ = adapted.hidden_states(ids, aux_layer_ids=[2])
    assert not torch.allclose(a1, a2)


def test_missing_chat_template_is_an_early_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    d = tmp_path / "m"
    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=8)).save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(d)
    with pytest.raises(TargetError, match="no chat template; set target.chat_template"):
        load_target(str(d))
    t = load_target(str(d), chat_template="{{ messages[0]['content'] }}")
    assert t.tokenizer.chat_template
    with pytest.raises(TargetError, match="not a model directory"):
        load_target(str(tmp_path))


def test_gguf_cache_serves_the_same_target(smollm2, tmp_path, monkeypatch, capsys):
    """The de-quantised GGUF kept as an HF directory gives the very weights, identity and tokenizer of
    reading the GGUF itself; a damaged copy is read again from the GGUF, never trusted."""
    from specheads.target import bundled_gguf_path, gguf_cache_dir, load_tokenizer

    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", "off")
    assert gguf_cache_dir(bundled_gguf_path()) is None
    direct = load_target("smollm2-135m")                     # no cache at all: the GGUF itself
    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", str(tmp_path / "cache"))
    cache = gguf_cache_dir(bundled_gguf_path())
    first = load_target("smollm2-135m", dtype="bfloat16")    # reads the GGUF, writes the cache
    assert (cache / "model" / "model.safetensors").is_file() and (cache / "tokenizer").is_dir()
    second = load_target("smollm2-135m", dtype="bfloat16")   # from the cache
    for t in (first, second):
        sd, ref = t.model.state_dict(), direct.model.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k].to(torch.bfloat16)) for k in ref)
        assert t.identity() == direct.identity() == smollm2.identity()
        assert t.name == "smollm2-135m" and t.tokenizer.chat_template == direct.tokenizer.chat_template
    text = "Hello <|im_start|>user\n12345 \t ü café\n```py\nx=1\n```"
    assert second.tokenizer(text).input_ids == direct.tokenizer(text).input_ids
    assert second.model.config.architectures == direct.model.config.architectures
    assert not hasattr(second.model.config, "quantization_config")

    (cache / "tokenizer" / "tokenizer.json").write_text("{not json")
    capsys.readouterr()
    tok = load_tokenizer("smollm2-135m")
    assert "unreadable" in capsys.readouterr().err
    assert tok(text).input_ids == direct.tokenizer(text).input_ids
    assert load_tokenizer("smollm2-135m")(text).input_ids == direct.tokenizer(text).input_ids  # rewritten


def test_gguf_config_is_read_once_then_from_the_cache(tmp_path, monkeypatch, capsys):
    """target_facts of a GGUF file (what prepare, dump and export read without the weights) parses the file's
    metadata once and keeps the config beside the de-quantised copy: the same facts from the cache, and a
    damaged copy read again from the GGUF."""
    from specheads.target import bundled_gguf_path, gguf_cache_dir, target_facts

    src = str(bundled_gguf_path())
    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", "off")
    direct = target_facts(src)
    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", str(tmp_path / "cache"))
    cache = gguf_cache_dir(bundled_gguf_path())
    assert target_facts(src) == direct and (cache / "config" / "config.json").is_file()
    assert direct["num_hidden_layers"] == 30 and direct["hidden_size"] == 576 and direct["vocab_size"] == 49152
    (cache / "config" / "config.json").write_text("{not json")
    capsys.readouterr()
    assert target_facts(src) == direct
    assert "unreadable" in capsys.readouterr().err
    assert target_facts(src) == direct and json.loads((cache / "config" / "config.json").read_text())


def test_gguf_cache_key_follows_the_file(tmp_path, monkeypatch):
    from specheads.target import gguf_cache_dir

    monkeypatch.setenv("SPECHEADS_GGUF_CACHE", str(tmp_path / "c"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 64)
    a = gguf_cache_dir(f)
    f.write_bytes(b"GGUF" + b"\1" * 64)
    b = gguf_cache_dir(f)
    assert a != b and a.parent == b.parent == tmp_path / "c" and a.name.startswith("m-")
