"""Command-line entry points: `preft` (generate, demo, adapters) and `preft-admin`."""
