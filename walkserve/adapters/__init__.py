"""Integrations of upstream models with walkserve, and the built-in example models."""
