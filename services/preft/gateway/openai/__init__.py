"""The OpenAI generation API: completions and chat (tools, logprobs, thinking), tokenize, models; the generation
service that owns the order of checks around the engine call."""
