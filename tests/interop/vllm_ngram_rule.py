"""vLLM's own n-gram look-up (``_find_longest_matched_ngram_and_propose_tokens``, the numba
kernel behind ``method: "ngram"``) over histories from a JSON file.

Usage (under the vLLM interpreter): ``python vllm_ngram_rule.py IN.json OUT.json`` with
IN = ``{"min_n", "max_n", "k", "histories": [[int]]}``; OUT = ``{"drafts": [[int]]}``.
"""
import json
import sys

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as lookup

if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    drafts = [lookup(np.asarray(h, dtype=np.int32), int(job["min_n"]), int(job["max_n"]), 1 << 20, int(job["k"])).tolist()
              for h in job["histories"]]
    with open(sys.argv[2], "w") as f:
        json.dump({"drafts": drafts}, f)
