"""The exported speculators directory, read by the real ``speculators`` 0.9.0 package.

speculators runs in its own virtual environment (``.cache/venvs/speculators``,
built once by ``tests/interop/speculators_venv.py``: torch==2.13.0 first,
then speculators==0.9.0 with torch pinned, then torchvision/torchaudio
removed).  If it cannot be installed beside torch 2.13.0 the tests skip
with pip's reason.

What is compared (``Eagle3DraftModel.forward``, speculators 0.9.0
``models/eagle3/core.py``): a teacher-forced TTT unroll over one packed
row.  Inputs: ``hidden_states`` = the raw concatenated aux states
``[1, T, 3H]`` (fc applied inside), ``input_ids`` already shifted so that
position t holds x_{t+1} (``shift_batch``), ``document_ids``,
``position_ids``.  Step k embeds ``input_ids`` shifted left by k more
(right-padded with 0) and concatenates the embedding with the previous
step's pre-norm output (the normed one with ``norm_output``); attention =
causal over step-0 keys + the diagonal of every earlier step; positions
+1 per step; logits = ``lm_head(norm(h))`` over the DRAFT vocabulary.  The
verifier's norm and lm_head are used only for the loss targets (not
without ``verifier_last_hidden_states``), so the draft logits are compared
directly, draft-vocab ids against draft-vocab ids.  Ours:
``ttt_forward(head, x, aux, steps)`` (step 0 =
``head.forward_step(shift_left(x, 1), head.project(aux), positions)``),
which pads with 0 the same way, so every position is comparable.

Tolerance: fp32 export, |Δlogits| ≤ 1e-4 and identical argmax (measured
≤ 1e-5; logits are of order 6).  bf16 export (the default): speculators
computes in bf16, we in fp32 over the same rounded weights: |Δ| ≤ 10% of
the logit scale and ≥ 95% identical argmax.  T = 128 because speculators' default attention
(``simple_flex_attention`` with a block mask extended per TTT step)
only works when T is a multiple of the 128-token block.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from interop import tiny
from interop.speculators_venv import DEFAULT_DIR, VenvError, ensure_venv

pytestmark = pytest.mark.speculators

REPO = Path(__file__).resolve().parent.parent
T = 128
STEPS = 3
ATOL = 1e-4         # fp32 export, fp32 compute on both sides
BF16_RTOL = 0.10    # bf16 export: speculators computes in bf16 (measured 0.19 / 0.38 / 0.30 at steps 0-2, scale ~6.5)


@pytest.fixture(scope="session")
def speculators_python():
    d = Path(os.environ.get("SPECHEADS_SPECULATORS_VENV", DEFAULT_DIR))
    t = time.time()
    try:
        py, built = ensure_venv(d)
    except VenvError as e:
        pytest.skip(f"speculators==0.9.0 cannot be installed beside torch==2.13.0 here:\n{e}")
    except subprocess.TimeoutExpired as e:
        pytest.skip(f"building the speculators venv timed out: {e}")
    print(f"\nspeculators venv {d}: {'built in %.0fs' % built if built else 'reused'} ({time.time() - t:.0f}s)")
    return py


def _export(run_dir: Path, out: Path, dtype: str) -> Path:
    from specheads.cli import main

    rc = main(["export", str(run_dir), "--format", "speculators", "--out", str(out), "--dtype", dtype, "--k", "4"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory, speculators_python):
    """Export four heads, run them all in one speculators process, return ours and theirs per case."""
    from specheads.formats import speculators as spec_fmt
    from specheads.heads import ttt_forward
    from specheads.heads.mtp import shift_left

    root = tmp_path_factory.mktemp("interop")
    verifier = tiny.tiny_verifier(root / "verifier").resolve()
    vw = load_file(str(verifier / "model.safetensors"))
    embed = vw["model.embed_tokens.weight"]
    cases = {
        # name: (head, export dtype, include the embedding)
        "draft_vocab_fp32": (tiny.eagle3_head(embed=embed, seed=1), "float32", True),
        "full_vocab_nbr_fp32": (tiny.eagle3_head(draft_vocab=tiny.VT, norm_before_residual=True, embed=embed,
                                                 seed=2), "float32", True),
        "draft_vocab_bf16": (tiny.eagle3_head(embed=embed, seed=3), "bfloat16", True),
        "no_embedding_fp32": (tiny.eagle3_head(embed=embed, seed=4), "float32", False),
    }
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, tiny.VT, (1, T), generator=g)
    aux = torch.randn(1, T, len(tiny.AUX) * tiny.H, generator=g)
    inputs = root / "inputs.safetensors"
    save_file({"hidden_states": aux, "input_ids": shift_left(x, 1, 0), "position_ids": torch.arange(T)[None],
               "document_ids": torch.zeros(1, T, dtype=torch.long)}, str(inputs))
    jobs, res = [], {}
    for name, (head, dtype, with_embed) in cases.items():
        out = root / name / "export"
        if with_embed:
            run = tiny.fake_run(root / name, head, target_name=str(verifier))
            _export(run, out, dtype)
        else:  # not reachable from the CLI (it always writes the embedding): the format module directly
            from specheads.export.stage import build_meta

            meta = build_meta(head, {"target": tiny.identity(str(verifier))}, 4)
            spec_fmt.save(head, meta, out, dtype=torch.float32, include_embedding=False)
        ref_head = head
        if dtype != "float32":  # compare with the weights as stored (bf16-rounded), computed in fp32
            from specheads.formats import load_any

            ref_head = load_any(out)[0]
            ref_head.embed_tokens.weight.data.copy_(head.embed_tokens.weight.to(torch.bfloat16).float())
        with torch.no_grad():
            ours = ttt_forward(ref_head.float().eval(), x, aux, steps=STEPS)
        res[name] = {"head": head, "dir": out, "ours": ours, "output": root / f"{name}.safetensors"}
        jobs.append({"model_dir": str(out), "inputs": str(inputs), "output": str(root / f"{name}.safetensors"),
                     "ttt_steps": STEPS})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([str(speculators_python), str(REPO / "tests" / "interop" / "speculators_forward.py"),
                        str(root / "jobs.json")], capture_output=True, text=True, timeout=900, env=env,
                       cwd=str(root))
    assert p.returncode == 0, f"speculators forward failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    for r in res.values():
        r["theirs"] = load_file(str(r["output"]))
        r["info"] = json.loads(Path(str(r["output"]) + ".json").read_text())
    res["_verifier"] = vw
    return res


CASES = ["draft_vocab_fp32", "full_vocab_nbr_fp32", "draft_vocab_bf16"]


@pytest.mark.parametrize("case", CASES + ["no_embedding_fp32"])
def test_loads_as_eagle3_draft_model(interop, case):
    info, head = interop[case]["info"], interop[case]["head"]
    assert info["class"] == "Eagle3DraftModel"
    assert info["speculators"] == "0.9.0" and info["torch"].startswith("2.13.0")
    assert info["aux_layer_ids"] == tiny.AUX
    assert info["norm_before_residual"] is head.cfg.norm_before_residual
    assert info["draft_vocab_size"] == head.cfg.draft_vocab_size
    assert info["use_draft_vocab"] is (not head.cfg.full_vocab)
    assert info["fc_in_features"] == len(tiny.AUX) * tiny.H
    assert info["speculative_tokens"] == 4
    assert info["embed_finite"] and info["lm_head_finite"] and info["verifier_lm_head_finite"]


@pytest.mark.parametrize("case", CASES)
def test_same_draft_logits_every_ttt_step(interop, case):
    r = interop[case]
    bf16 = r["info"]["dtype"] == "bfloat16"
    assert bf16 == case.endswith("bf16")  # speculators computes in the dtype the config names
    for k in range(STEPS):
        theirs, ours = r["theirs"][f"logits_{k}"], r["ours"][k].float()
        assert theirs.shape == ours.shape == (1, T, r["head"].cfg.draft_vocab_size)
        diff = float((theirs - ours).abs().max())
        scale = float(ours.abs().max())
        same = float((r["theirs"][f"tokens_{k}"] == ours.argmax(-1)).float().mean())
        print(f"{case} step {k}: max |speculators - specheads| = {diff:.2e} (logit scale {scale:.2f}), "
              f"same argmax {same:.1%}")
        if bf16:  # their activations are bf16, ours fp32 over the same bf16-rounded weights
            assert diff <= BF16_RTOL * max(1.0, scale), f"{case} step {k}: logits differ by {diff:.3g}"
            assert same >= 0.95
        else:
            assert diff <= ATOL, f"{case} step {k}: logits differ by {diff:.3g}"
            assert same == 1.0, f"{case} step {k}: draft tokens differ"
    # speculators' default positions start at 1: RoPE is relative, so step 0 is unchanged
    d = float((r["theirs"]["logits_default_pos_0"] - r["ours"][0]).abs().max())
    assert d <= (BF16_RTOL * max(1.0, float(r["ours"][0].abs().max())) if bf16 else ATOL)


@pytest.mark.parametrize("case", ["draft_vocab_fp32", "draft_vocab_bf16"])
def test_vocab_mapping_agrees(interop, case):
    """Same d2t/t2d, and speculators' verifier lm_head rows (target lm_head[t2d]) are the rows of our draft ids."""
    r = interop[case]
    head, theirs = r["head"], r["theirs"]
    assert torch.equal(theirs["d2t"], head.d2t) and torch.equal(theirs["t2d"], head.t2d)
    target_ids = head.draft_to_target(torch.arange(head.cfg.draft_vocab_size))
    dt = getattr(torch, r["info"]["dtype"])  # their verifier weights are cast to the model dtype
    v = interop["_verifier"]
    assert torch.equal(theirs["verifier_lm_head"], v["lm_head.weight"][target_ids].to(dt).float())
    assert torch.equal(theirs["verifier_norm"], v["model.norm.weight"].to(dt).float())


def test_no_vocab_mapping_for_full_vocab(interop):
    assert "d2t" not in interop["full_vocab_nbr_fp32"]["theirs"]


def test_missing_embedding_is_not_reliably_the_verifiers(interop):
    """speculators 0.9.0 (transformers 5.19) does not reliably take a missing ``embed_tokens.weight`` from
    the verifier: the loader leaves the key as uninitialised memory and ``load_verifier_weights`` copies the
    verifier's only when that memory happens to hold a NaN.  Measured: values up to 1e23 on one run (logits
    off by 7), rows close to the verifier's on another (logits off by 0.04) - whatever the allocator
    reused.  Hence the exporter always writes the embedding, and ``validate.check`` rejects a speculators
    dir without one."""
    from specheads.export import validate

    r = interop["no_embedding_fp32"]
    emb = r["theirs"]["embed_tokens"]
    verifier = interop["_verifier"]["model.embed_tokens.weight"]
    if not torch.equal(emb, verifier):  # kept the uninitialised memory: the model they run is not ours
        assert not torch.equal(r["theirs"]["logits_0"], r["ours"][0])
    rep = validate.check(r["dir"], raise_on_error=False)
    assert not rep.ok and any("embed_tokens.weight" in e for e in rep.errors)


# ------------------------------------------------------------------ P-EAGLE and DFlash
@pytest.fixture(scope="module")
def parallel_interop(tmp_path_factory, speculators_python):
    """A peagle and a dflash export (fp32, draft vocabulary), loaded by speculators' from_pretrained."""
    from specheads.formats import speculators as spec_fmt
    from specheads.export.stage import build_meta
    from specheads.heads import DFlashHead, HeadConfig, PEagleHead

    root = tmp_path_factory.mktemp("parallel")
    verifier = tiny.tiny_verifier(root / "verifier").resolve()
    vw = load_file(str(verifier / "model.safetensors"))
    common = dict(hidden_size=tiny.H, intermediate_size=tiny.I, num_attention_heads=tiny.NH,
                  num_key_value_heads=tiny.KV, target_vocab_size=tiny.VT, draft_vocab_size=tiny.VD,
                  rms_norm_eps=1e-5, target_num_layers=tiny.L, target_architectures=["LlamaForCausalLM"])
    heads = {"peagle": PEagleHead(HeadConfig(kind="peagle", aux_layer_ids=list(tiny.AUX), num_layers=2,
                                             num_depths=3, mask_token_id=5, **common)),
             "dflash": DFlashHead(HeadConfig(kind="dflash", aux_layer_ids=[1, 4, 7], num_layers=2, block_size=4,
                                             mask_token_id=5, **common))}
    sel = torch.randperm(tiny.VT, generator=torch.Generator().manual_seed(3))[:tiny.VD].sort().values
    jobs, res = [], {}
    for name, h in heads.items():
        tiny.rnd(h, seed=7)
        h.init_from_target(vw["model.embed_tokens.weight"], vw["lm_head.weight"], sel - torch.arange(tiny.VD))
        if name == "dflash":  # trained rows differ from the target's only through training; keep them random
            tiny.rnd(h.lm_head, seed=8)
        out = root / name
        spec_fmt.save(h.eval(), build_meta(h, {"target": tiny.identity(str(verifier))}, 3), out, dtype=torch.float32)
        jobs.append({"model_dir": str(out), "output": str(root / f"{name}.safetensors")})
        res[name] = {"head": h, "output": root / f"{name}.safetensors"}
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    p = subprocess.run([str(speculators_python), str(REPO / "tests" / "interop" / "speculators_parallel_load.py"),
                        str(root / "jobs.json")], capture_output=True, text=True, timeout=900, env=env, cwd=str(root))
    assert p.returncode == 0, f"speculators load failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    for r in res.values():
        r["theirs"] = load_file(str(r["output"]))
        r["info"] = json.loads(Path(str(r["output"]) + ".json").read_text())
    return res


@pytest.mark.parametrize("name, cls", [("peagle", "PEagleDraftModel"), ("dflash", "DFlashDraftModel")])
def test_parallel_heads_load_with_our_weights(parallel_interop, name, cls):
    """speculators builds the same module from our config and holds our tensors (mask_hidden, d2t/t2d, the
    DFlash lm_head of the draft vocabulary), with the verifier's embedding."""
    r = parallel_interop[name]
    info, head, theirs = r["info"], r["head"], r["theirs"]
    assert info["class"] == cls and info["speculators_model_type"] == name
    assert info["mask_token_id"] == 5 and info["num_layers"] == 2 and info["use_draft_vocab"]
    assert info["speculative_tokens"] == head.cfg.tokens_per_forward == 3
    assert info["aux"] == head.cfg.aux_layer_ids
    if name == "dflash":
        assert info["block_size"] == 4
    ours = head.state_dict()
    compared = [k for k in ours if k in theirs]
    assert {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d",
            "layers.1.mlp.down_proj.weight"} <= set(compared)
    assert name != "peagle" or "mask_hidden" in compared
    for k in compared:
        assert torch.equal(theirs[k].to(ours[k].dtype), ours[k]), k
