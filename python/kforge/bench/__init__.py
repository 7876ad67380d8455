"""Benchmarks: `python -m kforge.bench {ops,gpt2,llama,launch}` (GPU)."""
