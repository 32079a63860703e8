"""An untrained EAGLE-3 head shaped for SmolLM2-135M (draft vocab 32000, aux layers as the recipe), exported in
the speculators format: for step timings with --random-weights (the step's shapes are fixed, its cost is not
the head's quality)."""
import sys, torch
from transformers import LlamaConfig
from specheads.heads import Eagle3Head, HeadConfig
from specheads.export import speculators

cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                  tie_word_embeddings=True, rms_norm_eps=1e-5)
hc = HeadConfig.from_target_config(cfg, "eagle3", draft_vocab_size=32000, aux_layer_ids=[2, 15, 27])
torch.manual_seed(0)
h = Eagle3Head(hc)
d2t = torch.zeros(32000, dtype=torch.long)          # draft id i -> target id i
h.set_vocab_mapping(d2t)
speculators.save(h, None, sys.argv[1])
print("wrote", sys.argv[1])
