"""`specheads eval --sweep`: which configuration to serve with, measured.

Every swept drafter (each head; n-gram and suffix decoding when ``eval.compare`` names them) at every k of
``eval.sweep.k`` serves the eval conversations with continuous batching (``chat_continuous``: a finished
turn's slot takes the next request at once, as in a server) at every concurrency of
``eval.sweep.concurrency``; plain decoding at the same concurrency is the baseline and gives the reference
outputs. A P-EAGLE or DFlash head runs only the k one forward drafts: vLLM serves it with that k.

Per point: τ = decode tokens per target decode forward, request by request (the engine counts each row's
forwards; the first token of a request is its prefill's, and a request's last forward counts the tokens it
kept before its stop token or length cap); tok/s = every generated token over the wall time
(prefills included), the median of ``eval.sweep.repeat`` timed passes after an untimed one (each pass's rate is
kept); speedup = tok/s ÷ plain tok/s at the same concurrency; lossless = greedy outputs
identical to plain's. Per concurrency the recommendation is the point with the best speedup, plain decoding
(1.00×) among them; a tie (equal to the two decimals the report shows) goes to the smaller k, so to plain
before any drafted point, then to the drafter swept first. With it go the exact vLLM ``--speculative-config``
and SGLang flags, from the builders the model card uses (``formats.card``) and the vLLM side-by-side uses
(``vllm_compare.speculative_config_for``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specheads.evaluate.lossless import greedy_lossless
from specheads.evaluate.report import PLAIN_NAME
from specheads.evaluate.vllm_compare import speculative_config_for
from specheads.formats import card
from specheads.formats.convert import detect_format
from specheads.runtime.chat import chat_continuous
from specheads.runtime.drafters import forget_responses, make_drafter
from specheads.runtime.drafters.head import head_config
from specheads.runtime.engines.static import parallel_drafter

WEIGHTLESS_LABEL = {"ngram": "n-gram (vLLM's rule)", "suffix": "suffix decoding"}
WARM_TOKENS = 8        # a CPU warm-up's answer length: it only pays the first calls' one-off costs
SWEEP_PARTIAL = "sweep_partial.json"    # the points measured so far, in the eval's out directory while it runs


@dataclass
class Candidate:
    """One drafter of the sweep and the k it runs at."""
    label: str
    drafter: str                    # head directory, "ngram" or "suffix"
    ks: list[int]
    kind: str = ""                  # a head's kind (eagle3, eagle1, mtp, peagle, dflash), else the drafter's name
    fmt: str | None = None          # a head's format, as detect_format reads it
    instance: object = field(default=None, repr=False)   # the runtime drafter, built once for every point


def build_candidates(candidates: list[Candidate], load_head, compile: bool, notes: list[str]) -> None:
    """Each candidate's runtime drafter (``load_head(dir)``: a head made whole for the target), and a parallel
    head's k: the tokens one forward drafts."""
    for c in candidates:
        if c.drafter == "suffix":
            c.instance = make_drafter("suffix")
        elif c.drafter == "ngram":
            # on the device (continuous batching keeps no host state per row), vLLM's matching rule (the earliest
            # occurrence of the longest n-gram), so the τ behind a recommendation is what vLLM's proposer gets
            d = make_drafter("ngram", occurrence="earliest", ngram_backend="device")
            c.instance = d.compile() if compile else d
        else:
            c.instance = load_head(c.drafter)
            c.kind, c.fmt = head_config(c.instance.head).kind, detect_format(c.drafter)
            par = parallel_drafter(c.instance)
            if par is not None:
                n = par.tokens_per_forward
                notes.append(f"{c.label}: a {c.kind} head drafts {n} tokens in one forward, so it is swept at k={n} "
                             f"only (the k vLLM serves it with), not at eval.sweep.k")
                c.ks = [n]


def serving(c: Candidate | None, k: int, target: str) -> dict:
    """How to serve a point: vLLM's speculative config (JSON and ``vllm serve`` line) and SGLang's flags, or why
    SGLang has none. ``c`` None: plain decoding."""
    if c is None:
        return {"vllm_speculative_config": None, "vllm_flag": None, "vllm": f"vllm serve {target}",
                "sglang_flags": None, "sglang": f"python -m sglang.launch_server --model {target}",
                "sglang_note": None}
    if c.drafter in WEIGHTLESS_LABEL:
        d = c.instance
        spec, _ = speculative_config_for(c.drafter, k, ngram=(d.min_ngram, d.max_ngram)) if c.drafter == "ngram" \
            else speculative_config_for(c.drafter, k, suffix=d)
        flag = card.speculative_config_flag(spec)
        note = ("SGLang has no suffix decoding" if c.drafter == "suffix" else
                "SGLang's n-gram speculation is not the proposer measured here")
        return {"vllm_speculative_config": spec, "vllm_flag": flag, "vllm": f"vllm serve {target} {flag}",
                "sglang_flags": None, "sglang": None, "sglang_note": note}
    d = card.head_path_for_card(Path(c.drafter))    # the card's name for the folder: never an absolute path
    spec = card.vllm_speculative_config(d, k, c.fmt, c.kind)
    lines = card.launch_lines(target, d, k, c.fmt, c.kind)
    flags = card.sglang_flags(d, k, c.fmt, c.kind)
    return {"vllm_speculative_config": spec, "vllm_flag": card.speculative_config_flag(spec), "vllm": lines["vllm"],
            "sglang_flags": flags, "sglang": lines["sglang"],
            "sglang_note": None if flags else f"SGLang has no reader for a {c.kind} head"}


def _served(engine, tok, prompts, drafter, k: int, kw: dict, repeat: int = 1):
    """An untimed warm-up, then ``repeat`` timed serving runs: (the first run's results, its counts with
    ``seconds`` the runs' median, ``seconds_all`` each run's and ``tau_all`` each run's τ: the same in every run
    of a greedy sweep, or a pass drafted from another's answers)."""
    # on a GPU the whole stream once untimed: each step width and cache-length bucket captures its CUDA graph the
    # first time it is met, which would otherwise land inside the timed run; elsewhere the first calls' one-off
    # costs are all there is to pay
    warm = dict(kw) if kw["use_cuda_graphs"] else {**kw, "max_new_tokens": min(WARM_TOKENS, kw["max_new_tokens"])}
    chat_continuous(engine, tok, prompts if kw["use_cuda_graphs"] else prompts[:kw["batch_size"]],
                    drafter=drafter, k=k, **warm)
    runs = []
    for _ in range(repeat):
        forget_responses(drafter)   # suffix decoding: not the answers of the warm-up or of an earlier pass
        runs.append(chat_continuous(engine, tok, prompts, drafter=drafter, k=k, **kw))
    results, st = runs[0]
    times = [s["seconds"] for _, s in runs]
    return results, {**st, "seconds": statistics.median(times), "seconds_all": times,
                     "tau_all": [s.get("tau") for _, s in runs]}


def _rate(st: dict) -> float:
    return st["tokens"] / st["seconds"] if st["seconds"] else float("nan")


def _spread(st: dict) -> list[float]:
    """tok/s of each timed pass, slowest first."""
    return sorted(st["tokens"] / s for s in st["seconds_all"] if s)


def run_sweep(engine, target, prompts: list[dict], recipe, candidates: list[Candidate], notes: list[str],
              progress: Callable[[dict], None] | None = None) -> dict:
    """Plain decoding and every candidate at every k, at every concurrency; the points, the recommendation per
    concurrency and each drafter's best (report["sweep"]). ``progress`` gets the plain runs and points measured so
    far after each one (``complete`` False)."""
    e = recipe.eval
    tok, graphs = target.tokenizer, engine.device.type == "cuda"
    serve_target = recipe.target.verifier or target.verifier_name
    plain, points = [], []
    for C in e.sweep.concurrency:
        B = min(C, len(prompts))
        if B < C:
            notes.append(f"concurrency {C}: only {len(prompts)} conversations, so at most {B} requests were in "
                         f"flight (more prompts, eval.limit / eval.prompts, make this point mean {C})")
        # refills gathered: a prefill is one eager forward through every layer, dearer than the idle slots it saves
        kw = dict(max_new_tokens=e.max_new_tokens, batch_size=B, seed=recipe.seed, use_cuda_graphs=graphs,
                  refill_at=max(1, B // 8), pipeline_harvest=False)
        ref, st = _served(engine, tok, prompts, None, 0, kw, e.sweep.repeat)
        base = {"concurrency": C, "in_flight": B, "tokens": st["tokens"], "seconds": st["seconds"],
                "tokens_per_s": _rate(st), "tokens_per_s_passes": _spread(st)}
        plain.append(base)
        print(f"sweep, concurrency {C}: plain {base['tokens_per_s']:.1f} tok/s", flush=True)
        if progress:
            progress({"complete": False, "plain": plain, "points": points})
        for c in candidates:
            for k in c.ks:
                res, st = _served(engine, tok, prompts, c.instance, k, kw, e.sweep.repeat)
                p = {"concurrency": C, "in_flight": B, "drafter": c.label, "kind": c.kind,
                     "head": str(Path(c.drafter).resolve()) if c.drafter not in WEIGHTLESS_LABEL else None,
                     "k": k, "tau": st["tau"], "tokens": st["tokens"], "seconds": st["seconds"],
                     "tokens_per_s": _rate(st), "tokens_per_s_passes": _spread(st), "tau_passes": st["tau_all"],
                     "speedup": _rate(st) / base["tokens_per_s"],
                     "lossless": greedy_lossless(ref, res, target, tok), "serving": serving(c, k, serve_target)}
                points.append(p)
                ll = p["lossless"]
                print(f"sweep, concurrency {C}: {c.label} k={k}: τ={p['tau']:.3f}, {p['tokens_per_s']:.1f} tok/s, "
                      f"speedup {p['speedup']:.2f}×, {ll['identical']}/{ll['total']} identical", flush=True)
                if progress:
                    progress({"complete": False, "plain": plain, "points": points})
    recs = recommend(points, plain, serving(None, 0, serve_target))
    for r in recs:
        ll = r.get("lossless") or {}
        if ll.get("identical") != ll.get("total"):
            # kept as measured: batched and unbatched kernels may break near-ties differently (report.json gives
            # the target's logit margin at each divergence), but the reader has to know
            notes.append(f"concurrency {r['concurrency']}: the recommended {r['drafter']} k={r['k']} gave "
                         f"{ll.get('identical')}/{ll.get('total')} outputs identical to plain decoding's")
    return {"engine": "continuous batching", "target": serve_target, "concurrency": list(e.sweep.concurrency),
            "k": list(e.sweep.k), "repeat": e.sweep.repeat, "conversations": len(prompts),
            "turns": sum(len(p["turns"]) for p in prompts),
            "max_new_tokens": e.max_new_tokens, "plain": plain, "points": points, "recommendation": recs,
            "best": best_per_drafter(points), "notes": notes}


def _rank(p: dict) -> tuple:
    """Best first: the higher speedup as the report shows it (two decimals), then the smaller k."""
    s = p.get("speedup")
    return (-round(s, 2) if isinstance(s, float) and s == s else float("inf"), p.get("k", 0))


def recommend(points: list[dict], plain: list[dict], plain_serving: dict) -> list[dict]:
    """Per concurrency, the fastest point, plain decoding included (k 0, speedup 1.00)."""
    out = []
    for base in plain:
        C = base["concurrency"]
        none = {"concurrency": C, "in_flight": base["in_flight"], "drafter": PLAIN_NAME, "kind": "plain", "head": None,
                "k": 0, "tau": 1.0, "tokens_per_s": base["tokens_per_s"], "speedup": 1.0, "serving": plain_serving}
        here = [none] + [p for p in points if p["concurrency"] == C]
        best = min(here, key=_rank)     # min keeps the first of equals: plain, then the order of the sweep
        out.append({**best, "plain_tokens_per_s": base["tokens_per_s"]})
    return out


def best_per_drafter(points: list[dict]) -> list[dict]:
    """Each drafter's fastest k at each concurrency (what a head's model card recommends for that head)."""
    best: dict = {}
    for p in points:
        key = (p["head"] or p["drafter"], p["concurrency"])
        if key not in best or _rank(p) < _rank(best[key]):
            best[key] = p
    return [dict(p) for p in best.values()]
