"""Verify kernels: Triton == PyTorch reference (bit for bit), edge cases, and losslessness.

Runs the Triton kernels on CPU tensors through triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported). With ``TRITON_INTERPRET=0`` on a CUDA machine the same
tests run the compiled kernels on the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
scipy_stats = pytest.importorskip("scipy.stats")

from specheads import kernels  # noqa: E402
from specheads.kernels import verify_ref  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def _both(name, *args, **kw):
    a = getattr(kernels, name)(*args, backend="triton", **kw)
    b = getattr(kernels, name)(*args, backend="torch", **kw)
    assert type(a) is type(b)
    for field, x, y in zip(a._fields, a, b):
        assert x.dtype == y.dtype == torch.int64, field
        assert torch.equal(x.cpu(), y.cpu()), f"{name}.{field}:\ntriton={x}\ntorch ={y}"
    return b


def _probs(g, *shape, scale=2.0):
    return torch.softmax(torch.randn(*shape, generator=g) * scale, -1)


def _to(*ts):
    return [t.to(DEVICE) for t in ts]


# ---------------------------------------------------------------------------------- greedy
def test_greedy_handcrafted_ties_lowest_index():
    logits = torch.tensor([[[0.1, 0.9, 0.9, 0.0],  # argmax tie 1/2 -> 1
                            [0.5, 0.5, 0.5, 0.5],  # all tied -> 0
                            [0.0, 0.0, 0.0, 1.0]]])
    out = _both("greedy_verify", *_to(torch.tensor([[1, 0]]), logits))
    assert out.num_accepted.tolist() == [2] and out.out_tokens.tolist() == [[1, 0, 3]]
    out = _both("greedy_verify", *_to(torch.tensor([[2, 0]]), logits))  # first rejected
    assert out.num_accepted.tolist() == [0] and out.out_tokens.tolist() == [[1, -1, -1]]


def test_greedy_matches_reference_random():
    g = torch.Generator().manual_seed(1)
    B, K, V = 40, 4, 37
    logits = torch.randint(0, 4, (B, K + 1, V), generator=g).float()  # many ties
    am = verify_ref.argmax_lowest(logits)
    draft = am[:, :K].clone()
    cut = torch.randint(0, K + 1, (B,), generator=g)  # first mismatch position (K = all accepted)
    for b in range(B):
        if cut[b] < K:
            draft[b, cut[b]] = (am[b, cut[b]] + 1 + torch.randint(0, V - 1, (1,), generator=g)) % V
    draft[0] = am[0, :K]  # all accepted
    draft[1, 0] = (am[1, 0] + 1) % V  # first rejected
    draft[2, 2:] = -1  # padded drafts stop acceptance
    out = _both("greedy_verify", *_to(draft, logits))
    assert out.num_accepted[0] == K and out.num_accepted[1] == 0 and out.num_accepted[2] <= 2
    _both("greedy_verify", *_to(draft, logits.to(torch.bfloat16)))


# ---------------------------------------------------------------------------------- chains
def _chain_case(g, B, K, V):
    p = _probs(g, B, K + 1, V, scale=3.0)
    q = _probs(g, B, K, V)
    close = torch.rand(B, 1, 1, generator=g)  # drafts from near the target: varied acceptance lengths
    q = close * p[:, :K] + (1 - close) * q
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    ua = torch.rand(B, K, generator=g)
    us = torch.rand(B, generator=g)
    # edges: all accepted, first rejected, padded drafts, ties in the target, exact uniforms
    p[0, :K] = q[0]
    ua[0] = 0.0  # u*q < p with p = q > 0 -> all accepted, bonus from p[:, K]
    p[1, 0, x[1, 0]] = 0.0  # first draft impossible under the target -> rejected
    x[2, 1:] = -1  # only one draft proposed
    p[3] = torch.full((K + 1, V), 1.0 / V)  # flat target: ties everywhere
    us[3] = 0.5
    us[4] = 0.0
    us[5] = 1.0 - 2.0**-24
    return p, q, x, ua, us


@pytest.mark.parametrize("rule", ["rejection", "onehot"])
def test_chain_matches_reference_random(rule):
    g = torch.Generator().manual_seed(2)
    for B, K, V in [(48, 4, 50), (9, 1, 7), (6, 3, 1100)]:  # the last one spans two vocab blocks
        p, q, x, ua, us = _chain_case(g, B, K, V)
        if rule == "rejection":
            out = _both("rejection_verify", *_to(x, q, p, ua, us))
        else:
            out = _both("onehot_verify", *_to(x, p, ua, us))
        n, tokens = out.num_accepted.cpu(), out.out_tokens.cpu()
        assert n[0] == K and n[1] == 0 and n[2] <= 1
        assert (tokens[torch.arange(B), n] >= 0).all()
        prefix = torch.arange(K)[None] < n[:, None]
        assert torch.equal(tokens[:, :K][prefix], x[prefix])


def test_chain_no_drafts_and_bf16():
    g = torch.Generator().manual_seed(3)
    B, V = 6, 11
    p = _probs(g, B, 1, V)
    out = _both("onehot_verify", *_to(torch.zeros(B, 0, dtype=torch.long), p, torch.zeros(B, 0), torch.rand(B, generator=g)))
    assert out.num_accepted.tolist() == [0] * B
    p, q, x, ua, us = _chain_case(g, 8, 2, 13)
    _both("rejection_verify", *_to(x, q.bfloat16(), p.bfloat16(), ua, us))


def test_rejection_handcrafted():
    # V = 4, K = 1. p = [.5, .25, .25, 0], q = [.25, .75, 0, 0], draft x = 1: p/q = 1/3.
    p = torch.tensor([[[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.25, 0.75, 0.0, 0.0]]])
    x = torch.tensor([[1]])
    acc = _both("rejection_verify", *_to(x, q, p, torch.tensor([[0.3]]), torch.tensor([0.9])))
    assert acc.num_accepted.tolist() == [1] and acc.out_tokens.tolist() == [[1, 3]]
    # u = 0.34 > 1/3: rejected; residual max(p - q, 0) = [.25, 0, .25, 0] -> u_s = 0.49 -> 0, 0.5 -> 2
    rej = _both("rejection_verify", *_to(x, q, p, torch.tensor([[0.34]]), torch.tensor([0.49])))
    assert rej.num_accepted.tolist() == [0] and rej.out_tokens.tolist() == [[0, -1]]
    rej = _both("rejection_verify", *_to(x, q, p, torch.tensor([[0.34]]), torch.tensor([0.5])))
    assert rej.out_tokens.tolist() == [[2, -1]]
    # one-hot: accept iff u < p(x) = .25; on rejection p with x zeroed = [.5, 0, .25, 0] (/.75)
    oh = _both("onehot_verify", *_to(x, p, torch.tensor([[0.25]]), torch.tensor([2 / 3])))
    assert oh.num_accepted.tolist() == [0] and oh.out_tokens.tolist() == [[2, -1]]


# ---------------------------------------------------------------------------------- trees
def _random_trees(g, B, N, V, max_children=3):
    cand = torch.zeros(B, N, dtype=torch.long)
    nt = torch.full((B, N), -1, dtype=torch.long)
    ns = torch.full((B, N), -1, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        children = {0: []}
        cand[b, 0] = int(torch.randint(0, V, (1,), generator=g))
        for i in range(1, N):
            options = [j for j in range(i) if len(children[j]) < max_children]
            par = options[int(torch.randint(0, len(options), (1,), generator=g))]
            used = {int(cand[b, c]) for c in children[par]}
            tok = int(torch.randint(0, V, (1,), generator=g))
            while tok in used:
                tok = (tok + 1) % V
            cand[b, i] = tok
            if children[par]:
                ns[b, children[par][-1]] = i
            else:
                nt[b, par] = i
            children[par].append(i)
            children[i] = []
            depth[b, i] = depth[b, par] + 1
    # target probs that often agree with the tree: boost each node's children tokens
    logits = torch.randn(B, N, V, generator=g) * 2
    boost = torch.rand(B, N, generator=g) * 6
    for b in range(B):
        for i in range(N):
            c = int(nt[b, i])
            while c >= 0:
                logits[b, i, cand[b, c]] += boost[b, i]
                c = int(ns[b, c])
    return cand, nt, ns, torch.softmax(logits, -1), int(depth.max())


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.05, 0.5), (0.0, 0.0)])
def test_tree_matches_reference_random(thresholds):
    g = torch.Generator().manual_seed(4)
    B, N, V = 24, 9, 30
    cand, nt, ns, p, D = _random_trees(g, B, N, V)
    coins = torch.rand(B, N, generator=g)
    cf = torch.rand(B, generator=g)
    coins[0] = 0.0  # coin 0 accepts the first child (SGLang's "<=")
    coins[1] = 1.0 - 2.0**-24
    for depth in (D, 1):  # full depth and a truncated one
        out = _both("tree_verify", *_to(cand, nt, ns, p, coins, cf), depth, *thresholds)
        assert (out.num_accepted <= depth).all()
        assert (out.next_token >= 0).all()
        ai = out.accept_index
        assert (ai[:, 0] == 0).all()
    single = (torch.zeros(3, 1, dtype=torch.long), torch.full((3, 1), -1), torch.full((3, 1), -1),
              _probs(g, 3, 1, V), torch.rand(3, 1, generator=g), torch.rand(3, generator=g))
    out = _both("tree_verify", *_to(*single), 2)  # root only: no drafts
    assert out.num_accepted.tolist() == [0, 0, 0]


@pytest.mark.parametrize("thresholds, expected_accept, expected_out, expected_num", [
    ((1.0, 1.0), [[0, 3, 4, 5], [0, 4, 5, -1]], [[3, 4, 5, 18], [11, 12, 18, -1]], [3, 2]),
    ((0.0, 0.0), [[0, 1, 2, -1], [0, 4, 5, -1]], [[1, 2, 18, -1], [11, 12, 18, -1]], [2, 2]),
])
def test_tree_sglang_example(thresholds, expected_accept, expected_out, expected_num):
    """The case of sgl-kernel's tests/speculative/test_speculative_sampling.py (node indices local)."""
    cand = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    nt = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    ns = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    logits = torch.full((2, 6, 20), 1.0)
    logits[0, 0, 3] = logits[0, 3, 4] = logits[0, 4, 5] = logits[1, 0, 11] = logits[1, 4, 12] = 10
    for i in range(2):
        for j in range(6):
            if logits[i, j].max() < 10:
                logits[i, j, 18] = 10
    p = torch.softmax(logits / 0.01, -1)
    g = torch.Generator().manual_seed(5)
    out = _both("tree_verify", *_to(cand, nt, ns, p, torch.rand(2, 6, generator=g), torch.rand(2, generator=g)),
                3, *thresholds)
    assert out.accept_index.tolist() == expected_accept
    assert out.out_tokens.tolist() == expected_out
    assert out.num_accepted.tolist() == expected_num


# ---------------------------------------------------------------------------------- statistics
def _chi2_pvalue(observed: dict, expected: dict, draws: int) -> float:
    """Chi-square goodness of fit; categories expected < 5 draws are pooled into one bin."""
    unexpected = {k: v for k, v in observed.items() if expected.get(k, 0.0) <= 0.0}
    big = {k: e for k, e in expected.items() if e * draws >= 5}
    obs = [observed.get(k, 0) for k in big]
    exp = [big[k] * draws for k in big]
    rest_obs = draws - sum(obs)
    rest_exp = draws - sum(exp)
    if rest_exp >= 1e-9 or rest_obs:
        obs.append(rest_obs)
        exp.append(max(rest_exp, 1e-9))
    if unexpected:  # a sequence the target can never produce
        return 0.0
    scale = sum(obs) / sum(exp)  # scipy wants equal sums; absorbs float round-off of the law
    return float(scipy_stats.chisquare(obs, [e * scale for e in exp]).pvalue)


def _count(out_tokens, num_accepted):
    seqs = {}
    for row, n in zip(out_tokens.cpu().tolist(), num_accepted.cpu().tolist()):
        key = tuple(row[: n + 1])
        seqs[key] = seqs.get(key, 0) + 1
    return seqs


def _toy(V, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, V, generator=g), -1)


DRAWS = 12000


def test_rejection_and_onehot_keep_target_distribution():
    V, K = 6, 2
    P = _toy(V, K + 1, 10)  # target rows (the toy target does not depend on the prefix)
    Q = _toy(V, K, 11)
    g = torch.Generator().manual_seed(12)
    B = DRAWS
    x = torch.stack([torch.multinomial(Q[i], B, replacement=True, generator=g) for i in range(K)], 1)
    ua = torch.rand(B, K, generator=g)
    us = torch.rand(B, generator=g)
    p = P[None].expand(B, K + 1, V).contiguous()
    q = Q[None].expand(B, K, V).contiguous()
    out = _both("rejection_verify", *_to(x, q, p, ua, us))
    # law of the emitted sequence: at each position accept x with prob min(p, q)(x) (and then the
    # next position follows), else emit from the residual (p - min(p, q)) and stop; bonus from P[K]
    a = torch.minimum(P[:K], Q)
    expected = {}
    for v0 in range(V):
        expected[(v0,)] = float(P[0, v0] - a[0, v0])
        for v1 in range(V):
            expected[(v0, v1)] = float(a[0, v0] * (P[1, v1] - a[1, v1]))
            for v2 in range(V):
                expected[(v0, v1, v2)] = float(a[0, v0] * a[1, v1] * P[2, v2])
    pv = _chi2_pvalue(_count(out.out_tokens, out.num_accepted), expected, B)
    assert pv > 1e-3, pv
    # marginal of the first emitted token is exactly the target's
    first = torch.bincount(out.out_tokens[:, 0].cpu(), minlength=V)
    exp0 = P[0].double() / P[0].double().sum() * B
    assert scipy_stats.chisquare(first.double().numpy(), exp0.numpy()).pvalue > 1e-3

    # one-hot drafts: a fixed draft (x0, x1) = (1, 4)
    xo = torch.tensor([[1, 4]]).expand(B, K).contiguous()
    out = _both("onehot_verify", *_to(xo, p, ua, us))
    expected = {}
    for v0 in range(V):
        if v0 != 1:
            expected[(v0,)] = float(P[0, v0])
    for v1 in range(V):
        if v1 != 4:
            expected[(1, v1)] = float(P[0, 1] * P[1, v1])
    for v2 in range(V):
        expected[(1, 4, v2)] = float(P[0, 1] * P[1, 4] * P[2, v2])
    pv = _chi2_pvalue(_count(out.out_tokens, out.num_accepted), expected, B)
    assert pv > 1e-3, pv


def _toy_tree():
    # root(0) -> a(1, tok 2), b(2, tok 0), c(3, tok 5); a -> d(4, tok 1), e(5, tok 3)
    cand = torch.tensor([4, 2, 0, 5, 1, 3])
    nt = torch.tensor([1, 4, -1, -1, -1, -1])
    ns = torch.tensor([-1, 2, 3, -1, 5, -1])
    return cand, nt, ns


def _tree_law(cand, nt, ns, P, V, depth_left, node=0, prefix=(), mass=1.0, law=None):
    """Lossless law of the emitted sequence: target chain, continuing while tokens hit tree nodes."""
    law = {} if law is None else law
    children = {}
    c = int(nt[node]) if depth_left > 0 else -1
    while c >= 0:
        children[int(cand[c])] = c
        c = int(ns[c])
    for v in range(V):
        m = mass * float(P[node, v])
        if v in children:
            _tree_law(cand, nt, ns, P, V, depth_left - 1, children[v], prefix + (v,), m, law)
        else:
            law[prefix + (v,)] = law.get(prefix + (v,), 0.0) + m
    return law


@pytest.mark.parametrize("thresholds, lossless", [((1.0, 1.0), True), ((0.05, 0.5), False)])
def test_tree_keeps_target_distribution_only_when_lossless(thresholds, lossless):
    V, B = 6, DRAWS
    cand, nt, ns = _toy_tree()
    N = cand.shape[0]
    P = _toy(V, N, 20)
    P[0] = torch.tensor([0.2, 0.05, 0.1, 0.3, 0.25, 0.1])  # children tokens 2, 0, 5 moderately likely
    P[1] = torch.tensor([0.3, 0.1, 0.2, 0.15, 0.05, 0.2])
    g = torch.Generator().manual_seed(21)
    args = [cand[None].expand(B, N), nt[None].expand(B, N), ns[None].expand(B, N),
            P[None].expand(B, N, V), torch.rand(B, N, generator=g), torch.rand(B, generator=g)]
    out = _both("tree_verify", *_to(*[a.contiguous() for a in args]), 2, *thresholds)
    pv = _chi2_pvalue(_count(out.out_tokens, out.num_accepted), _tree_law(cand, nt, ns, P, V, 2), B)
    if lossless:
        assert pv > 1e-3, pv
    else:
        assert pv < 1e-6, pv


# ---------------------------------------------------------------------------------- dispatch
def test_dispatch_auto_and_lazy_triton_import():
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from specheads import kernels\n"
        "x = torch.zeros(2, 1, dtype=torch.long); t = torch.rand(2, 2, 5)\n"
        "assert kernels.resolve_backend('auto', t) == 'torch'\n"
        "out = kernels.greedy_verify(x, t)\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "import os; os.environ['SPECHEADS_KERNELS'] = 'triton'\n"
        "assert kernels.resolve_backend('auto', t) == 'triton'\n"
        "assert kernels.resolve_backend('torch', t) == 'torch'\n"
        "os.environ['SPECHEADS_KERNELS'] = 'torch'\n"
        "assert kernels.resolve_backend('auto', t) == 'torch'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPECHEADS_KERNELS"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120, cwd=repo)
    with pytest.raises(ValueError):
        kernels.greedy_verify(torch.zeros(2, 1, dtype=torch.long), torch.rand(2, 2, 5), backend="cuda")
