"""Trainer tests: tiny random heads (hidden 64, vocab 256) on synthetic feeds, real DeepSpeed path (CPU)."""
from __future__ import annotations

import json
from pathlib import Path
import shutil

import pytest
import torch

from specheads.config import recipe_from_dict
from specheads.formats.trained import load_trained_head
from specheads.rundir import ResumeMismatchError, RunDir
from specheads.train import BatchError, HeadShapeError, TrainingDivergedError, build_head, run_train
from specheads.train.losses import TargetLogits, TargetView, counted_positions, distill_step, simulated_tau
from specheads.train.run_log import read_metrics
from synthetic_target import DRAFT_VOCAB as VD, SyntheticFeed, synthetic_vocab, tiny_recipe, tiny_target



def make_recipe(run_dir, kind="eagle3", **train):
    head = {"kind": kind, "aux_layer_ids": [1, 2, 3] if kind == "eagle3" else None, "num_mtp_depths": 2}
    return tiny_recipe(run_dir, head, **{"ttt_steps": 3, "precision": "bf16", **train})


# ---------------------------------------------------------------- alignment (no DeepSpeed)
def test_counted_positions_hand_made():
    # T = 6; predicted tokens x_{t+2+k} must be loss-masked; target argmax at final_{t+1+k} in the draft vocab.
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    in_vocab = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    k0 = counted_positions(loss_mask, in_vocab, 0)
    k1 = counted_positions(loss_mask, in_vocab, 1)
    # k=0: t+2 ∈ {2,3,4} -> t ∈ {0,1,2}; in_vocab[t+1] drops t=2
    assert k0[0].nonzero().flatten().tolist() == [0, 1]
    # k=1: t+3 ∈ {2,3,4} -> t ∈ {0,1}; in_vocab[t+2] drops t=1
    assert k1[0].nonzero().flatten().tolist() == [0]
    attn = torch.tensor([[1, 1, 1, 1, 0, 0]])
    assert counted_positions(loss_mask, in_vocab, 0, attn)[0].nonzero().flatten().tolist() == [0, 1]


def test_distill_step_uses_row_t_plus_1_plus_k():
    T, V = 7, 5
    # target row r is peaked at token r % V
    tl = 30.0 * torch.nn.functional.one_hot(torch.arange(T) % V, V).float()[None]
    tv = TargetView(tl, (torch.arange(T) % V)[None], torch.ones(1, T, dtype=torch.bool))
    loss_mask = torch.ones(1, T, dtype=torch.long)
    for k in range(3):
        # a draft that predicts row t+1+k's argmax at position t is perfect only with the right alignment
        good = 30.0 * torch.nn.functional.one_hot((torch.arange(T) + 1 + k) % V, V).float()[None]
        bad = 30.0 * torch.nn.functional.one_hot((torch.arange(T) + 2 + k) % V, V).float()[None]
        rg = distill_step(good.requires_grad_(), tv, loss_mask, k, backend="torch")
        rb = distill_step(bad, tv, loss_mask, k, backend="torch")
        assert int(rg.count) == T - 2 - k
        assert float(rg.loss.detach()) < 1e-6 and int(rg.hits) == T - 2 - k
        assert float(rb.loss) > 10 and int(rb.hits) == 0
        rg.loss.backward()


def test_target_view_matches_next_token(target, vocab):
    """On the bigram feed the target argmax at final_r is x_{r+1}: step k at t is scored against x_{t+2+k}."""
    feed = SyntheticFeed(target, pad_last=0)
    b = next(iter(feed))
    full = TargetLogits(target.lm_head.weight)(b["final"])
    assert torch.equal(full.argmax[:, :-1], b["input_ids"][:, 1:])
    d2t, t2d, _ = vocab
    tv = TargetLogits(target.lm_head.weight, d2t)(b["final"])
    ids = torch.arange(VD) + d2t
    assert tv.logits.shape[-1] == VD
    assert torch.equal(tv.in_vocab, t2d[full.argmax])
    m = tv.in_vocab
    assert torch.equal(ids[tv.argmax[m]], full.argmax[m])
    assert simulated_tau([1.0, 0.5, 0.5]) == pytest.approx(1 + 1 + 0.5 + 0.25)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "mtp"])
def test_compiled_objective_matches_eager(kind, target, vocab, tmp_path):
    """train.compile: the head's forward through torch.compile gives the eager loss and gradients,
    over batches of two shapes (the second compile makes the lengths dynamic)."""
    import copy

    from specheads.train.losses import Objective, mtp_weights

    r = make_recipe(tmp_path, kind)
    built = build_head(r, target, vocab)
    weights = mtp_weights(r.head, built.cfg.num_mtp_depths, 0.8) if kind == "mtp" else None
    d2t = built.d2t if kind == "eagle3" else None
    objectives = [Objective(h, kind, steps=3, mtp_weights=weights, backend="torch", compile=c)
                  for h, c in ((built.head, False), (copy.deepcopy(built.head), True))]
    torch._dynamo.reset()
    for seq_len in (24, 32):
        b = next(iter(SyntheticFeed(target, seq_len=seq_len, seed=seq_len)))
        tv = TargetLogits(target.lm_head.weight, d2t)(b["final"])
        outs = [o(b, tv) for o in objectives]
        torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=1e-5, rtol=1e-5)
        for o, out in zip(objectives, outs):
            o.zero_grad(set_to_none=True)
            out.loss.backward()
        grads = [{n: p.grad for n, p in o.head.named_parameters() if p.requires_grad} for o in objectives]
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for n, g in grads[0].items():
            torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(Exception, match="zero_stage 3"):
        make_recipe(tmp_path, kind, compile=True, zero_stage=3)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "mtp"])
def test_filler_rows_and_positions_change_nothing(kind, target, vocab, tmp_path):
    """train.length_buckets pads a batch to its bucket shape (pad_batch): zero filler rows and positions
    leave the loss and the gradients as they were (no NaN from a row whose every key is masked); the
    compiled step with static shapes gives the eager loss at two bucket shapes."""
    import copy

    from specheads.dump.feed import pad_batch
    from specheads.train.losses import Objective, mtp_weights

    r = make_recipe(tmp_path, kind)
    built = build_head(r, target, vocab)
    weights = mtp_weights(r.head, built.cfg.num_mtp_depths, 0.8) if kind == "mtp" else None
    d2t = built.d2t if kind == "eagle3" else None
    eager = Objective(built.head, kind, steps=3, mtp_weights=weights, backend="torch")
    b = next(iter(SyntheticFeed(target, seq_len=24, batch_size=3)))
    padded = pad_batch(b, 5, 32)
    assert padded["input_ids"].shape == (5, 32) and padded["aux"].shape[:2] == (5, 32)
    assert int(padded["attention_mask"].sum()) == int(b["attention_mask"].sum())
    assert padded["row_ids"].tolist() == b["row_ids"].tolist() + [-1, -1]
    grads, losses = [], []
    for batch in (b, padded):
        eager.zero_grad(set_to_none=True)
        out = eager(batch, TargetLogits(target.lm_head.weight, d2t)(batch["final"]))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in eager.head.named_parameters() if p.requires_grad})
    assert torch.isfinite(losses[1])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(ValueError, match="does not fit the bucket shape"):
        pad_batch(b, 2, 32)
    if kind == "eagle3":  # one static compile per bucket shape, as the trainer runs it
        torch._dynamo.reset()
        static = Objective(copy.deepcopy(built.head), kind, steps=3, backend="torch", compile=True,
                           static_shapes=True)
        for rows, length in ((5, 32), (3, 48)):
            pb = pad_batch(b, rows, length)
            tv = TargetLogits(target.lm_head.weight, d2t)(pb["final"])
            torch.testing.assert_close(static(pb, tv).loss, eager(pb, tv).loss, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- builder
def test_builder_checks_and_lora(target, vocab, tmp_path):
    r = make_recipe(tmp_path)
    built = build_head(r, target, vocab)
    d2t = vocab[0]
    ids = torch.arange(VD) + d2t
    assert torch.equal(built.head.lm_head.weight, target.lm_head.weight[ids])
    assert not built.head.embed_tokens.weight.requires_grad
    bad = make_recipe(tmp_path)
    bad.head.aux_layer_ids = [1, 2, 9]
    with pytest.raises(HeadShapeError, match="out of range"):
        build_head(bad, target, vocab)
    other = synthetic_vocab(tiny_target(vocab=300), VD)
    with pytest.raises(HeadShapeError, match="target vocab of 300"):
        build_head(r, target, other)
    r.head.lora.enabled = True
    lb = build_head(r, target, vocab)
    trainable = [n for n, p in lb.head.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    from specheads.heads.lora import merged_state_dict

    assert set(merged_state_dict(lb.head)) == set(built.head.state_dict())


# ---------------------------------------------------------------- DeepSpeed runs
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "mtp"])
def test_overfit_each_head(kind, target, vocab, tmp_path):
    r = make_recipe(tmp_path / kind, kind, max_steps=30, eval_every=15, save_every=15)
    s = run_train(r, target=target, feed=SyntheticFeed(target), eval_feed=SyntheticFeed(target, shuffle=False),
                  vocab=vocab, progress=False)
    # bf16 is asked for: kept on a GPU, fp32 on a CPU (effective_precision)
    assert s["steps"] == 30 and s["precision"] == ("bf16" if torch.cuda.is_available() else "fp32")
    ev = [m for m in read_metrics(s["metrics"]) if m["split"] == "eval"]
    assert ev[0]["step"] == 0 and ev[-1]["step"] == 30
    assert ev[-1]["loss"] < 0.6 * ev[0]["loss"]
    assert ev[-1]["sim_tau"] > ev[0]["sim_tau"] + 0.5
    tr = [m for m in read_metrics(s["metrics"]) if m["split"] == "train"]
    assert all(m["grad_norm"] is not None and m["tokens_per_s"] > 0 for m in tr)
    assert tr[0]["lr"] < tr[3]["lr"]  # warmup
    # final/ and checkpoints load back as the same head
    head, meta = load_trained_head(tmp_path / kind)
    assert meta["kind"] == kind and meta["step"] == 30 and meta["target"]["name"] == target.name
    head_ck, _ = load_trained_head(tmp_path / kind / "train" / "checkpoints" / "step_30")
    for (n, a), (_, b) in zip(head.state_dict().items(), head_ck.state_dict().items()):
        assert torch.allclose(a.float(), b.float()), n
    if kind == "eagle3":
        assert torch.equal(head.d2t, vocab[0])
        cfg = json.loads((tmp_path / kind / "train" / "final" / "head_config.json").read_text())
        assert cfg["aux_layer_ids"] == [1, 2, 3] and cfg["draft_vocab_size"] == VD
        assert (tmp_path / kind / "train" / "plots" / "loss.png").is_file()


def test_compiled_training_follows_the_eager_curve(target, vocab, tmp_path):
    """train.compile through DeepSpeed: same loss curve as eager training, and the checkpoint holds the
    head's own parameter names (the compiled function wraps no module)."""
    curves = {}
    for c in (False, True):
        r = make_recipe(tmp_path / str(c), max_steps=8, eval_every=1000, save_every=8, compile=c)
        run_train(r, target=target, feed=SyntheticFeed(target, seed=5), vocab=vocab, progress=False)
        curves[c] = [m["loss"] for m in read_metrics(tmp_path / str(c) / "train" / "metrics.jsonl")
                     if m["split"] == "train"]
    assert len(curves[True]) == 8
    assert curves[True] == pytest.approx(curves[False], rel=1e-4, abs=1e-5)
    a, _ = load_trained_head(tmp_path / "False")
    b, _ = load_trained_head(tmp_path / "True")
    assert a.state_dict().keys() == b.state_dict().keys()


def test_resume_equals_uninterrupted(target, vocab, tmp_path):
    kw = dict(max_steps=12, save_every=6, grad_accum=2, scheduler="cosine", warmup_steps=3)
    a = run_train(make_recipe(tmp_path / "a", **kw), target=target, feed=SyntheticFeed(target, seed=3),
                  vocab=vocab, progress=False)
    # simulate an interruption right after step 6: a new run dir holding only the step-6 checkpoint
    src = tmp_path / "a" / "train" / "checkpoints"
    dst = tmp_path / "b" / "train" / "checkpoints"
    shutil.copytree(src / "step_6", dst / "step_6")
    (dst / "latest").write_text("step_6")
    b = run_train(make_recipe(tmp_path / "b", resume=True, **kw), target=target,
                  feed=SyntheticFeed(target, seed=3), vocab=vocab, progress=False)
    assert b["start_step"] == 6 and b["steps"] == 12
    la = {m["step"]: m["loss"] for m in read_metrics(a["metrics"]) if m["split"] == "train"}
    lb = {m["step"]: m["loss"] for m in read_metrics(b["metrics"]) if m["split"] == "train"}
    assert sorted(lb) == list(range(7, 13))
    for s in range(7, 13):
        assert lb[s] == pytest.approx(la[s], rel=1e-5, abs=1e-6), s
    ha, _ = load_trained_head(tmp_path / "a")
    hb, _ = load_trained_head(tmp_path / "b")
    for (n, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), n
    # resuming with another recipe says which fields differ
    bad = make_recipe(tmp_path / "b", resume=True, **{**kw, "max_steps": 14}, lr=1e-3)
    with pytest.raises(ResumeMismatchError) as ei:
        run_train(bad, target=target, feed=SyntheticFeed(target, seed=3), vocab=vocab, progress=False)
    msg = str(ei.value)
    assert "train.lr" in msg and "train.max_steps" in msg and "train.ttt_steps" not in msg


def test_nan_stops_and_keeps_last_good_checkpoint(target, vocab, tmp_path):
    r = make_recipe(tmp_path, max_steps=10, save_every=2)
    with pytest.raises(TrainingDivergedError) as ei:
        run_train(r, target=target, feed=SyntheticFeed(target, nan_batch=4), vocab=vocab, progress=False)
    assert ei.value.step == 5 and ei.value.rows is not None
    assert "optimizer step 5" in str(ei.value) and "batch rows" in str(ei.value)
    ck = tmp_path / "train" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_4"
    assert not (ck / "step_5").exists() and not (tmp_path / "train" / "final").exists()
    head, meta = load_trained_head(ck / "step_4")
    assert all(torch.isfinite(p).all() for p in head.parameters())
    report = json.loads((tmp_path / "train" / "diverged.json").read_text())
    assert report["step"] == 5 and report["rows"] == list(ei.value.rows)
    assert len(report["input_ids_shape"]) == 2
    assert f"input_ids shape {tuple(report['input_ids_shape'])}" in str(ei.value)


def test_bad_dump_is_reported(target, vocab, tmp_path):
    r = make_recipe(tmp_path, max_steps=2)
    with pytest.raises(BatchError, match="another target or aux layer set"):
        run_train(r, target=target, feed=SyntheticFeed(target, aux_width=2 * 64), vocab=vocab, progress=False)


# ---------------------------------------------------------------- the real feed (dump store, make_feed)
def _token_rows(n=20, seed=0, vocab=256):
    import numpy as np

    g = np.random.default_rng(seed)
    return [{"input_ids": g.integers(0, vocab, int(k)).tolist(),
             "loss_mask": (g.random(int(k)) < 0.7).astype(int).tolist()} for k in g.integers(6, 24, n)]


def test_offline_dump_feed_and_mismatch(tmp_path):
    from specheads.dump import run_dump
    from specheads.errors import DumpError

    tgt = tiny_target(layers=8)
    base = {"run_dir": str(tmp_path), "seed": 0, "data": {"max_length": 32},
            "dump": {"dtype": "float32", "shard_tokens": 128, "batch_tokens": 64},
            "vocab": {"draft_vocab_size": None}, "head": {"kind": "eagle3"},
            "train": {"ttt_steps": 2, "max_steps": 4, "micro_batch_size": 2, "eval_every": 2, "eval_fraction": 0.25,
                      "save_every": 2, "loss_kernel": "torch", "logging": {"wandb": "disabled"}}}
    r = recipe_from_dict(base)
    run_dump(r, target=tgt, rows=_token_rows(), progress=False)
    s = run_train(r, target=tgt, progress=False)  # feeds from make_feed: train + held-out eval split
    assert s["steps"] == 4 and s["eval"] is not None and s["eval"]["positions"] > 0
    _, meta = load_trained_head(tmp_path)
    assert meta["aux_layer_ids"] == [2, 4, 5] and meta["target"]["config_hash"] == tgt.config_hash
    # a head asking for other aux layers than the dump holds: the feed refuses, the error surfaces
    bad = recipe_from_dict({**base, "head": {"kind": "eagle3", "aux_layer_ids": [1, 3, 6]},
                            "train": {**base["train"], "overwrite": True}})  # a new run over the first one's outputs
    with pytest.raises(DumpError, match=r"layer"):
        run_train(bad, target=tgt, progress=False)


def test_torch_adamw_when_fused_adam_cannot_build(target, vocab, tmp_path, monkeypatch):
    from specheads.train import engine

    monkeypatch.setattr(engine, "fused_adam_problem", lambda: "simulated op build failure")
    s = run_train(make_recipe(tmp_path, max_steps=3), target=target, feed=SyntheticFeed(target), vocab=vocab,
                  progress=False)
    assert s["steps"] == 3 and s["losses"][-1] < s["losses"][0]


def test_warm_start_from_export_with_lora(target, vocab, tmp_path):
    from specheads.formats import speculators

    r0 = make_recipe(tmp_path / "src")
    src = build_head(r0, target, vocab).head
    with torch.no_grad():
        src.fc.weight.mul_(0.5)  # something a fresh init would not give
    out = speculators.save(src, None, tmp_path / "export", dtype=torch.float32)
    r = make_recipe(tmp_path / "run", max_steps=4, save_every=2)
    r.head.warm_start = str(out)
    r.head.lora.enabled = True
    s = run_train(r, target=target, feed=SyntheticFeed(target), vocab=vocab, progress=False)
    assert s["steps"] == 4
    head, meta = load_trained_head(tmp_path / "run")
    assert meta["lora"]["r"] == 16 and meta["warm_start"]["format"] == "speculators"
    assert torch.equal(head.fc.weight, src.fc.weight)  # not a LoRA target: frozen
    assert not torch.equal(head.layers[0].self_attn.q_proj.weight, src.layers[0].self_attn.q_proj.weight)
    ck, _ = load_trained_head(tmp_path / "run" / "train" / "checkpoints" / "step_4")  # LoRA keys, merged on load
    assert torch.allclose(ck.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight, atol=1e-6)
    # a warm start for another target shape is refused
    r.head.aux_layer_ids = [1, 2]
    with pytest.raises(HeadShapeError, match="aux_layer_ids"):
        build_head(r, target, vocab)


_DDP_SCRIPT = '''
import json, os, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
from specheads.config import recipe_from_dict
from specheads.train import run_train
from synthetic_target import tiny_target, SyntheticFeed, synthetic_vocab
run_dir, resume = sys.argv[1], sys.argv[2] == "1"
rank = int(os.environ["RANK"])
tgt = tiny_target()
r = recipe_from_dict({"run_dir": run_dir, "head": {"kind": "eagle3", "aux_layer_ids": [1, 2, 3]},
                      "train": {"ttt_steps": 2, "max_steps": 6, "save_every": 3, "eval_every": 3, "lr": 3e-3,
                                "loss_kernel": "torch", "resume": resume, "logging": {"wandb": "disabled"}}})
s = run_train(r, target=tgt, feed=SyntheticFeed(tgt, seed=rank), vocab=synthetic_vocab(tgt, 128),
              eval_feed=SyntheticFeed(tgt, seed=10 + rank, shuffle=False), progress=False)
# a file per rank: two processes sharing one stdout pipe can lose or interleave lines at teardown
with open(os.path.join(run_dir, f"result_rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": s["world_size"], "losses": s["losses"]}, f)
'''


def test_two_ranks_under_torchrun_with_resume(tmp_path):
    """The launcher path (torchrun, 2 CPU processes, gloo/shm): per-rank data and state, exact resume."""
    import socket
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT.replace("{tests!r}", repr(str(Path(__file__).resolve().parent))))

    def launch(run_dir, resume):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(port), str(script), str(run_dir), "1" if resume else "0"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        files = sorted(Path(run_dir).glob("result_rank*.json"))
        assert files, p.stdout[-3000:] + p.stderr[-3000:]
        return [json.loads(f.read_text()) for f in files]

    a = launch(tmp_path / "a", False)
    assert len(a) == 2 and all(x["world"] == 2 for x in a) and a[0]["losses"] == a[1]["losses"]
    ck = tmp_path / "a" / "train" / "checkpoints" / "step_3"
    assert (ck / "rank_0.pt").is_file() and (ck / "rank_1.pt").is_file()
    shutil.copytree(ck, tmp_path / "b" / "train" / "checkpoints" / "step_3")
    (tmp_path / "b" / "train" / "checkpoints" / "latest").write_text("step_3")
    b = launch(tmp_path / "b", True)
    assert b[0]["losses"] == pytest.approx(a[0]["losses"][3:], rel=1e-5)


@pytest.mark.slow
def test_smollm2_end_to_end_offline(smollm2, tmp_path):
    """The bundled SmolLM2 target: vocab stage files, dump, make_feed, train, final/ loads back."""
    from specheads.data.vocab import save_vocab, select_draft_vocab
    from specheads.dump import run_dump

    tok = smollm2.tokenizer
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Water boils at 100 degrees.",
             "Speculative decoding drafts tokens.", "One, two, three, four, five, six."] * 2
    rows = []
    for t in texts:
        ids = tok(t)["input_ids"][:40]
        rows.append({"input_ids": ids, "loss_mask": [0] * 2 + [1] * (len(ids) - 2)})
    r = recipe_from_dict({"run_dir": str(tmp_path), "data": {"max_length": 64}, "vocab": {"draft_vocab_size": 512},
                          "dump": {"dtype": "bfloat16"},
                          "train": {"ttt_steps": 2, "max_steps": 3, "micro_batch_size": 2, "eval_every": 3,
                                    "eval_fraction": 0.2, "loss_kernel": "torch", "logging": {"wandb": "offline"}}})
    save_vocab(RunDir(r).vocab, *select_draft_vocab(rows, 512, smollm2.vocab_size))
    run_dump(r, target=smollm2, rows=rows, progress=False)
    s = run_train(r, target=smollm2, progress=False)
    assert s["steps"] == 3 and all(torch.isfinite(torch.tensor(s["losses"])))
    head, meta = load_trained_head(tmp_path)
    assert meta["aux_layer_ids"] == [2, 15, 27] and head.cfg.draft_vocab_size == 512
    assert head.cfg.hidden_size == 576 and torch.equal(head.embed_tokens.weight, smollm2.embed_tokens.weight)
    assert (tmp_path / "train" / "wandb").is_dir()


def test_head_fc_bias_from_the_recipe(target, vocab, tmp_path):
    """head.fc_bias=false gives an EAGLE-1 head vLLM serves (its llama_eagle has no fc bias): the export
    passes vLLM's check; the default keeps the original EAGLE layout; EAGLE-3 refuses a bias."""
    from specheads.formats import eagle
    from specheads.export import validate

    r = make_recipe(tmp_path, "eagle1")
    assert build_head(r, target, vocab).head.fc.bias is not None
    r = recipe_from_dict({**r.to_dict(), "head": {**r.to_dict()["head"], "fc_bias": False}})
    head = build_head(r, target, vocab).head
    assert head.fc.bias is None and head.cfg.fc_bias is False
    eagle.save(head, None, tmp_path / "e1")
    validate.check(tmp_path / "e1")
    r3 = make_recipe(tmp_path, "eagle3")
    r3 = recipe_from_dict({**r3.to_dict(), "head": {**r3.to_dict()["head"], "fc_bias": True}})
    with pytest.raises(HeadShapeError, match="EAGLE-3 heads have no fc bias"):
        build_head(r3, target, vocab)


def test_profile_steps_write_the_operator_table(target, vocab, tmp_path):
    """train.profile_steps: the profiler covers exactly the asked optimizer steps and its table
    lands in the run directory; a window that is not [first <= last] is refused by name."""
    r = make_recipe(tmp_path / "p", max_steps=6, profile_steps=[2, 4])
    s = run_train(r, target=target, feed=SyntheticFeed(target), vocab=vocab, progress=False)
    text = (tmp_path / "p" / "train" / "profile.txt").read_text()
    assert s["profile"] == str(tmp_path / "p" / "train" / "profile.txt")
    assert text.startswith("# torch.profiler, optimizer steps 2..4 (3 steps") and "aten::mm" in text
    with pytest.raises(ValueError, match="train.profile_steps"):
        make_recipe(tmp_path / "q", profile_steps=[3, 2])
    # a window past the run's end closes with the run
    s = run_train(make_recipe(tmp_path / "e", max_steps=3, profile_steps=[2, 9]), target=target,
                  feed=SyntheticFeed(target), vocab=vocab, progress=False)
    assert "optimizer steps 2..3 (2 steps" in Path(s["profile"]).read_text()


def test_deepspeed_logs_go_above_the_progress_bar(capsys):
    """DeepSpeed logs to stdout while the bar draws on stderr: during training its records go through
    tqdm.write (bar cleared, line written, bar redrawn), never into the middle of the bar's line."""
    import logging
    import sys
    from types import SimpleNamespace

    from deepspeed.utils import logger as ds_logger

    from specheads.train.loop import _progress_bar

    own = logging.StreamHandler(sys.stdout)  # as DeepSpeed's own handler, on this test's stdout
    saved, ds_logger.handlers = ds_logger.handlers, [own]
    try:
        run = SimpleNamespace(rank=0, total=3, cfg=SimpleNamespace(kind="eagle3"))
        with _progress_bar(run, 0, True) as bar:
            bar.update(1)
            assert own not in ds_logger.handlers  # routed through tqdm while the bar is up
            ds_logger.warning("a DeepSpeed warning")
        assert ds_logger.handlers == [own]
        with _progress_bar(SimpleNamespace(rank=1), 0, True) as bar:  # other ranks draw no bar
            assert bar is None
    finally:
        ds_logger.handlers = saved
    out = capsys.readouterr()
    assert "a DeepSpeed warning\n" in out.out and "train eagle3" in out.err


# ---------------------------------------------------------------- train.max_minutes
class _Clock:
    """A clock that advances a fixed step on each reading: the loop reads it once a step (``spent``)."""

    def __init__(self, tick=1.0):
        self.t, self.tick = 0.0, tick

    def __call__(self):
        self.t += self.tick
        return self.t


def test_time_budget_replans_from_the_measured_rate():
    from specheads.train.budget import TimeBudget
    from specheads.train.engine import LRLambda

    sched = LRLambda(100, 5, "cosine", 0.1)
    clock = _Clock(0.0)
    b = TimeBudget(1.0, 100, sched, 0, "cpu", clock=clock)
    clock.t = 10.0
    assert b.plan(10, 100) == 100  # the first window (compilation) is not a rate
    clock.t = 20.0  # 1 s a step: 40 s left fit 40 more steps
    assert b.plan(20, 100) == 60 and sched.total == 60
    clock.t = 25.0  # faster now (0.5 s a step): 35 s left fit 70 more, but never past the recipe's 100
    assert b.plan(30, 60) == 100 and sched.total == 100
    clock.t = 59.0
    assert not b.spent()
    clock.t = 60.0
    assert b.spent()
    assert [r["total"] for r in b.summary(30)["replans"]] == [60, 100]


def test_max_minutes_ends_the_run_with_the_schedule_decayed(target, vocab, tmp_path, monkeypatch):
    import specheads.train.loop as loop
    from specheads.train.budget import TimeBudget

    clock = _Clock(1.0)
    monkeypatch.setattr(loop, "TimeBudget", lambda *a, **kw: TimeBudget(*a, **kw, clock=clock))
    r = make_recipe(tmp_path, max_steps=400, max_minutes=0.5, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
    s = run_train(r, target=target, feed=SyntheticFeed(target), vocab=vocab, progress=False)
    tb = s["time_budget"]
    assert tb["planned_steps"] == 400 and tb["replans"]
    assert 10 < s["steps"] < 40 and s["total_steps"] == s["steps"]  # about 30 ticks of the clock
    rows = [m for m in read_metrics(s["metrics"]) if m["split"] == "train"]
    assert rows[-1]["step"] == s["steps"]
    assert rows[-1]["lr"] < 0.3 * 3e-3  # the LR decayed by the new last step, not cut at its peak
    _, meta = load_trained_head(tmp_path)
    assert meta["step"] == s["steps"]
