"""Benchmarks and their record: `python -m kforge.bench {models,ops,gpt2,llama,launch}` measure on a
CUDA GPU and append each run to benchmarks/records.jsonl; `report` generates BENCHMARKS.md and
docs/plots from it (see `python -m kforge.bench --help`)."""
