"""Command-line entry points: `preft` (generate, demo)."""
