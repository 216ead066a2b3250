"""Tenants manage their adapters (upload, versions, aliases), share them, and read their token usage."""
