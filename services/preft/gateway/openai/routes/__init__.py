"""The OpenAI generation routes, one module per resource."""
