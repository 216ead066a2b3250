"""The core of the gateway: settings, keys and tenants, rate limits and quotas, adapter resolution, the engine
and registry clients, the tokenizer and its guard, metering, errors, and the dependencies every route uses."""
