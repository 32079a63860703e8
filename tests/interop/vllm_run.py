"""Run one vLLM configuration in vLLM's own venv and write JSON results.

Usage (under the vLLM interpreter): ``python tests/interop/vllm_run.py JOB.json``.

The worker itself is ``worker_main`` in ``specheads/evaluate/vllm_worker.py`` — the same code
``specheads eval --engine vllm`` runs — loaded here by path, because the vLLM venv does not
have specheads installed (and must not import it: that file imports only the
standard library and vLLM).  JOB.json: ``model``, ``dtype``, ``max_model_len``, ``max_tokens``,
``temperature``, ``ignore_eos``, ``speculative_config`` (or null), ``conversations``
(``id``, ``turns``, ``prompt_token_ids`` per turn), ``output``.  The output holds, per turn,
the prompt ids fed, the generated ids, the finish reason, vLLM's per-step accepted/drafted
counts (``per_request_spec_decode_metrics="detailed"``) and the deltas of the Prometheus
counters ``vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens /
_num_accepted_tokens_per_pos``; plus start-up seconds, generate seconds and tokens/s.
"""
import runpy
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "specheads" / "evaluate" / "vllm_worker.py"

if __name__ == "__main__":
    mod = runpy.run_path(str(WORKER), run_name="specheads_vllm_worker")
    sys.exit(mod["worker_main"](sys.argv[1]))
