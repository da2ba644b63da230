"""Kiln's software-defined assets, one module per pipeline step."""
