"""Workarounds for torch bugs and gaps, each with the upstream issue and the torch versions it applies to."""
