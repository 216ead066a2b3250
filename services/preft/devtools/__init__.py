"""Generated tiny models, tokenizers and adapters for the demo, tests and CPU benchmarks (nothing is downloaded)."""
