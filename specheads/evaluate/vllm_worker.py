"""The vLLM half of ``specheads eval --engine vllm``: one configuration in vLLM's own venv.

Run by path under vLLM's interpreter (``python vllm_worker.py JOB.json``): vLLM's
virtual environment does not have specheads installed, so this file imports only
the standard library and vLLM. One ``vllm.LLM`` per process, prompts fed as token
ids, one conversation at a time (batch 1, as our eval runs by default), results
written as JSON. ``vllm_compare.py`` beside it writes the jobs and reads the results.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _counters(llm) -> dict:
    out = {c: 0 for c in COUNTERS}
    out[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] += int(getattr(m, "value", 0))
        elif m.name == PER_POS:
            vals = list(getattr(m, "values", []))
            acc = out[PER_POS]
            out[PER_POS] = [(acc[i] if i < len(acc) else 0) + (vals[i] if i < len(vals) else 0)
                            for i in range(max(len(acc), len(vals)))]
    return out


def _delta(a: dict, b: dict) -> dict:
    d = {c: b[c] - a[c] for c in COUNTERS}
    pa, pb = a[PER_POS], b[PER_POS]
    d[PER_POS] = [pb[i] - (pa[i] if i < len(pa) else 0) for i in range(len(pb))]
    return d


def _render(tok, messages):
    """specheads.runtime.chat.render_prompt, verbatim (the worker cannot import specheads)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _resolved(llm) -> dict:
    """What vLLM made of the speculative config: method, draft architecture, aux layer ids."""
    try:
        vc = llm.llm_engine.vllm_config
    except AttributeError:
        return {}
    sc = vc.speculative_config
    out = {"target_model": vc.model_config.model, "target_architectures": list(vc.model_config.architectures or []),
           "dtype": str(vc.model_config.dtype), "max_model_len": vc.model_config.max_model_len}
    if sc is None:
        return out
    out.update(method=sc.method, num_speculative_tokens=sc.num_speculative_tokens,
               prompt_lookup_min=getattr(sc, "prompt_lookup_min", None),
               prompt_lookup_max=getattr(sc, "prompt_lookup_max", None))
    dmc = getattr(sc, "draft_model_config", None)
    if dmc is not None and sc.method not in ("ngram",):
        hf = dmc.hf_config
        ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
        src = "top level"
        if not ids and isinstance(getattr(hf, "eagle_config", None), dict):
            ids, src = hf.eagle_config.get("eagle_aux_hidden_state_layer_ids"), "eagle_config"
        out.update(draft_model=dmc.model, draft_architectures=list(getattr(hf, "architectures", None) or []),
                   aux_layer_ids=list(ids) if ids else None, aux_layer_ids_from=src if ids else None,
                   draft_vocab_size=getattr(hf, "draft_vocab_size", None),
                   norm_before_residual=getattr(hf, "norm_before_residual", None))
        dflash = getattr(hf, "dflash_config", None)
        if isinstance(dflash, dict):     # DFlash numbers its layers by output: one below the HF index
            out["dflash_target_layer_ids"] = dflash.get("target_layer_ids")
    return out


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=int(job["max_model_len"]),
              gpu_memory_utilization=0.3, enforce_eager=True, disable_log_stats=False, seed=int(job.get("seed", 0)),
              enable_prefix_caching=False, max_num_seqs=int(job.get("max_num_seqs", 8)))
    if job.get("tokenizer"):
        kw["tokenizer"] = job["tokenizer"]
    if job.get("speculative_config"):
        kw["speculative_config"] = job["speculative_config"]
    model_cfg = Path(job["model"]) / "config.json"
    speculators_model = model_cfg.is_file() and "speculators_model_type" in json.loads(model_cfg.read_text())
    if job.get("speculative_config") or speculators_model:   # vLLM refuses it without speculative decoding
        kw["per_request_spec_decode_metrics"] = "detailed"
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    stops = set()
    for t in (tok.eos_token_id, getattr(llm.llm_engine.model_config.hf_config, "eos_token_id", None)):
        stops.update(t if isinstance(t, list) else ([t] if t is not None else []))
    sp = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=float(job.get("temperature", 0.0)),
                        top_k=max(0, int(job.get("top_k", 0))),
                        top_p=float(job.get("top_p", 1.0)), ignore_eos=bool(job.get("ignore_eos", False)),
                        seed=int(job["seed"]) if job.get("temperature", 0.0) > 0 else None, detokenize=False)
    if job.get("warmup", True):  # first-call costs (allocations, numba JIT) stay out of the timings
        first = (job["conversations"][0].get("prompt_token_ids") or [None])[0] if job["conversations"] else None
        ids = first or _render(tok, [{"role": "user", "content": "Hi"}])
        for _ in range(2):
            llm.generate([TokensPrompt(prompt_token_ids=list(ids))], SamplingParams(max_tokens=16, temperature=0.0),
                         use_tqdm=False)
    before_all = _counters(llm)
    results, gen_s, gen_tokens = [], 0.0, 0
    for conv in job["conversations"]:
        msgs = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
        given = conv.get("prompt_token_ids") or []
        turns = []
        for t, text in enumerate(conv["turns"]):
            msgs.append({"role": "user", "content": text})
            rendered = _render(tok, msgs)
            ids = given[t] if t < len(given) and given[t] else rendered
            c0 = _counters(llm)
            t1 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
            secs = time.perf_counter() - t1
            c1 = _counters(llm)
            co = out.outputs[0]
            toks = list(co.token_ids)
            sdm = co.spec_decode_metrics
            turns.append({
                "prompt_token_ids": list(ids),
                "rendered_matches_given": (rendered == list(given[t])) if t < len(given) and given[t] else None,
                "token_ids": toks, "finish_reason": co.finish_reason, "seconds": secs,
                "spec": None if sdm is None else {
                    "per_step_accepted": list(sdm.per_step_accepted), "per_step_drafted": list(sdm.per_step_drafted),
                    "num_draft_tokens": int(sdm.num_draft_tokens), "histogram": list(sdm.histogram)},
                "counters": _delta(c0, c1),
            })
            gen_s += secs
            gen_tokens += len(toks)
            answer = toks[:-1] if toks and toks[-1] in stops else toks
            msgs.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        results.append({"id": conv["id"], "turns": turns})
    res = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "startup_s": startup,
           "resolved": _resolved(llm), "stop_token_ids": sorted(stops), "results": results,
           "generate_s": gen_s, "generated_tokens": gen_tokens,
           "tokens_per_s": gen_tokens / gen_s if gen_s > 0 else None,
           "counters": _delta(before_all, _counters(llm))}
    Path(job["output"]).write_text(json.dumps(res))
    print(f"vllm worker: {len(results)} conversations, {gen_tokens} tokens in {gen_s:.1f}s "
          f"(start-up {startup:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(worker_main(sys.argv[1]))
