"""Runtime on a GPU: CUDA-graph steps give the same tokens as eager steps (skipped without CUDA)."""

import pytest
import torch

from specheads.runtime.drafters import Eagle3Drafter, NGramDrafter
from specheads.runtime.generate import generate
from specheads.runtime.model import TargetModel
from specheads.runtime.tree import TreeConfig

from test_runtime import PROMPTS, V, _head, tiny  # tests/ is on sys.path (rootdir conftest)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_llama():
    hf = tiny("llama").cuda()
    return hf, TargetModel.from_hf(hf, max_batch=4, max_seq=160)


def test_cuda_logits_match_hf(cuda_llama):
    hf, m = cuda_llama
    ids = torch.randint(0, V, (2, 12), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits
    m.reset()
    torch.testing.assert_close(m(ids).logits, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("mode", ["plain", "ngram", "eagle3", "eagle3_tree", "sampled"])
def test_cuda_graphs_match_eager(cuda_llama, mode):
    _, m = cuda_llama
    kw = {"stop_token_ids": ()}
    if mode == "ngram":
        kw.update(drafter=NGramDrafter(1, 3), k=3)
    elif mode.startswith("eagle3"):
        kw.update(drafter=Eagle3Drafter(_head("eagle3", 48).cuda()))
        kw.update(tree=TreeConfig(3, 2, 5)) if mode.endswith("tree") else kw.update(k=3)
    elif mode == "sampled":
        kw.update(drafter=NGramDrafter(1, 3), k=3, rule="onehot", temperature=0.8, seed=3)
    eager = generate(m, PROMPTS, 20, **kw)
    graphed = generate(m, PROMPTS, 20, use_cuda_graphs=True, **kw)
    again = generate(m, PROMPTS, 20, use_cuda_graphs=True, **kw)        # replays captured graphs
    assert graphed.tokens == eager.tokens
    assert again.tokens == eager.tokens
    if mode != "sampled":
        assert eager.tokens == generate(m, PROMPTS, 20, stop_token_ids=()).tokens
