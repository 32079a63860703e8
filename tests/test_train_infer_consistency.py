"""The runtime drafts exactly what the trainer trains: every first draft token the EAGLE-3 drafter
proposes during batched generation equals the argmax of the teacher-forced TTT step-0 logits at the
same position of the final sequence. (Output equality alone cannot show this: verification keeps the
output lossless whatever the drafts are.)"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.heads.config import HeadConfig
from specheads.heads.eagle3 import Eagle3Head
from specheads.heads.ttt import ttt_forward
from specheads.runtime.drafters import drafter_for_head
from specheads.runtime.engines.static import generate
from specheads.runtime.model import TargetModel


def test_drafter_proposals_equal_ttt_step0():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, eos_token_id=95)
    target = LlamaForCausalLM(cfg).eval()
    hc = HeadConfig.from_target_config(cfg, "eagle3", draft_vocab_size=64, aux_layer_ids=[1, 3, 5])
    head = Eagle3Head(hc).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d2t = torch.sort(torch.randperm(96)[:64]).values
    head.set_vocab_mapping(d2t - torch.arange(64)) if hasattr(head, "set_vocab_mapping") else head.d2t.copy_(d2t - torch.arange(64))
    prompts = [torch.randint(0, 95, (n,)).tolist() for n in (5, 11, 8)]
    eng = TargetModel.from_hf(target, max_batch=3, max_seq=128)
    dr = drafter_for_head(head)
    log, orig = [], dr.propose

    def spy(ctx, k):
        p = orig(ctx, k)
        log.append(([len(h) for h in ctx.histories], p.tokens.tolist(), list(ctx.active)))
        return p

    dr.propose = spy
    res = generate(eng, prompts, 20, drafter=dr, k=3, stop_token_ids=())
    checked = 0
    for b, p in enumerate(prompts):
        x = torch.tensor([p + res.tokens[b]])
        with torch.no_grad():
            hs = target(x, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in hc.aux_layer_ids], -1)
            first = head.draft_to_target(ttt_forward(head, x, aux, None, 1)[0][0].argmax(-1))
        for lens, toks, act in log:
            if act[b]:
                assert toks[b][0] == int(first[lens[b] - 2]), (b, lens[b])
                checked += 1
    assert checked >= 30
