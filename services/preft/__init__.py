"""preft-serve: serve many per-user adapters at base-model speed by applying them to prompt tokens only."""

__version__ = "0.1.0"
