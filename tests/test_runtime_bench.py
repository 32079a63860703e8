"""benchmarks/bench_runtime.py end to end on the CPU: a tiny target with SmolLM2's tokenizer and a
random EAGLE-3 head exported in the speculators format; every drafter row, JSON, plot, profile."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_runtime", REPO / "benchmarks" / "bench_runtime.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_runtime_cpu(tiny_target_dir, tmp_path, capsys):
    from transformers import AutoConfig

    from specheads.formats.speculators import save
    from specheads.heads import HeadConfig, build_head

    cfg = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    hc = HeadConfig.from_target_config(cfg, "eagle3", aux_layer_ids=[1, 3, 5])
    head = build_head(hc).eval()
    save(head, None, tmp_path / "head", dtype=torch.float32)
    out = tmp_path / "bench.json"
    res = _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--batches", "1,2", "--new-tokens", "6",
                         "--head", str(tmp_path / "head"), "--min-match", "2", "--out", str(out), "--profile-all",
                         "--profile-batch", "2", "--serve", "10", "--serve-harvest", "pipelined,sync"])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["drafter"].split(" ")[0]) for r in rows] == [
        (b, d) for b in (1, 2) for d in ("plain", "ngram", "head", "hybrid")]
    for r in rows:
        assert r["tokens"] == 6 * r["batch"] and r["tau"] >= 1.0 and r["tokens_per_s"] > 0
        assert r["decode_tokens_per_s"] > 0 and 0 < r["prefill_s"] < r["seconds"]
        assert abs(r["speedup"] - r["tokens_per_s"] / r["plain_tokens_per_s"]) < 1e-9
        assert abs(r["speedup_over_tau"] - r["speedup"] / r["tau"]) < 1e-9
        plain = next(p for p in rows if p["batch"] == r["batch"] and p["drafter"] == "plain")
        assert abs(r["decode_speedup"] - r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]) < 1e-9
        assert r["drafter"] == "plain" or r["lossless"] is True
        # plain re-timed after the drafted rows: the same outputs, and each row's speedup against it too
        assert r["plain_after_lossless"] is True and r["plain_after_tokens_per_s"] > 0
        assert abs(r["speedup_vs_plain_after"] - r["tokens_per_s"] / r["plain_after_tokens_per_s"]) < 1e-9
        assert abs(r["speedup_vs_plain_after_over_tau"] - r["speedup_vs_plain_after"] / r["tau"]) < 1e-9
    assert "| 2 | hybrid (min_match 2) |" in text and "speedup ÷ τ" in text and "speedup after prefill ÷ τ" in text
    assert "plain tok/s, re-timed after" in text
    # serving: 10 mixed-set prompts through 1 and 2 slots, continuous batching, every drafter lossless
    serving = json.loads(out.read_text())["serving"]
    assert [(r["batch"], r["harvest"], r["drafter"].split(" ")[0]) for r in serving] == [
        (b, h, d) for b in (1, 2) for h in ("pipelined", "sync") for d in ("plain", "ngram", "head", "hybrid")]
    # the harvest one block behind: the same tokens and target forwards per request (a slot is
    # refilled a block later, so the batch's step count may differ)
    for at in (0, 8):
        assert [(r["tokens"], r["tau"]) for r in serving[at:at + 4]] == \
            [(r["tokens"], r["tau"]) for r in serving[at + 4:at + 8]]
    for r in serving:
        assert r["requests"] == 10 and r["lossless"] is True and r["tau"] >= 1.0 and r["tokens_per_s"] > 0
        assert abs(r["speedup_over_tau"] - r["speedup"] / r["tau"]) < 1e-9
        assert set(r["tau_by_category"]) <= {"chat", "code", "extraction", "math", "qa", "summarization", "translation"}
    assert serving[0]["tau"] == 1.0 and serving[0]["tokens"] == serving[1]["tokens"]
    assert "Serving: 10 requests" in text and "Serving τ per category" in text
    assert "Profile: one plain decode step" in text and "Profile: one hybrid" in text
    assert "Profile: one ngram" in text and "Profile: one head (eagle3)" in text      # --profile-all: every drafter
    assert res["attention"] == "torch"                                                 # SDPA on a CPU
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert res["profile"]["plain"]["eager_ms_per_step"] > 0
    assert res["profile_batch"] == 2 and "Profile: one plain decode step, batch 2" in text
    with pytest.raises(SystemExit):  # a profile batch that was not benchmarked: refused before anything runs
        _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--batches", "1,2", "--profile",
                       "--profile-batch", "4"])


def test_bench_runtime_random_head(tiny_target_dir, tmp_path):
    """--random-head: an untrained EAGLE-3 head built for the target (no exported file), drafting losslessly."""
    out = tmp_path / "bench.json"
    _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--batches", "1,2", "--new-tokens", "5",
                   "--random-head", "--drafters", "head,hybrid", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["head"] == "random (untrained)"
    assert [(r["batch"], r["drafter"].split(" ")[0]) for r in res["rows"]] == [
        (b, d) for b in (1, 2) for d in ("plain", "head", "hybrid")]
    assert all(r["lossless"] is True and r["tokens"] == 5 * r["batch"] for r in res["rows"])
    with pytest.raises(SystemExit):
        _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--head", "x", "--random-head"])


def test_bench_runtime_isolate(tiny_target_dir, tmp_path, capsys):
    """--isolate: each row timed in a process of its own, compared across them (speedup, outputs) as one table."""
    out = tmp_path / "bench.json"
    res = _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--batches", "1,2", "--new-tokens", "5",
                         "--random-head", "--drafters", "ngram,head", "--isolate", "--out", str(out)])
    text = capsys.readouterr().out
    assert json.loads(out.read_text()) == res and res["isolated"] is True and res["head"] == "random (untrained)"
    assert [(r["batch"], r["drafter"].split(" ")[0]) for r in res["rows"]] == [
        (b, d) for b in (1, 2) for d in ("plain", "ngram", "head")]
    for r in res["rows"]:
        assert r["lossless"] is True and r["tokens"] == 5 * r["batch"] and "outputs" not in r
        plain = next(p for p in res["rows"] if p["batch"] == r["batch"] and p["drafter"] == "plain")
        assert r["plain_tokens_per_s"] == plain["tokens_per_s"]
        assert abs(r["speedup"] - r["tokens_per_s"] / plain["tokens_per_s"]) < 1e-9
        assert "plain_after_tokens_per_s" not in r            # nothing re-timed: plain had a process of its own
    assert "every row in a process of its own" in text and "identical to plain decoding: all rows" in text
    # without a head there is no head row, and the rest still runs
    res = _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--batches", "1", "--new-tokens", "4",
                         "--drafters", "ngram,head", "--isolate"])
    assert [r["drafter"] for r in res["rows"]] == ["plain", "ngram"]
    with pytest.raises(SystemExit):                           # no profile or serving in isolated processes
        _bench().main(["--device", "cpu", "--target", str(tiny_target_dir), "--isolate", "--profile"])
