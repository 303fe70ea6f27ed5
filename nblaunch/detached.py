"""Detached runs (placeholder, filled in below)."""
from __future__ import annotations


def detached_runs() -> list:
    return []


def attach(run_id: str):
    raise NotImplementedError


def start_detached(run_id, config, fn, args, kwargs):
    raise NotImplementedError
