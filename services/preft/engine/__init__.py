"""The PreFT engine: vLLM with the PreFT plugin, behind a small request/result API."""
