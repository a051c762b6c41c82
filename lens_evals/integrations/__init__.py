"""Integrations with other evaluation frameworks (each imports its framework on use)."""
