"""Generation: the shared pool of worker-group actors on Ray, each worker group's runtime,
and the generation engines behind them (HF on CPU, SGLang on GPU)."""
