"""Runnable examples built on kvplan and kvplan_nixl (not part of the installed package)."""
