"""What every service shares: the error tree, adapter references, settings."""
