"""Integrations with trainers (trainer process): one module per trainer, each imported on its
own.

Importing this package imports no trainer; ``weightsync.integrations.trl`` imports TRL only
when `use_weightsync` is called.
"""
