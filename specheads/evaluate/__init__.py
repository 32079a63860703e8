"""The eval stage: runs the engine on prompts, writes acceptance reports, compares with vLLM."""
