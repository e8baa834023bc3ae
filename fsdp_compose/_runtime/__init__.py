"""The runtime: hooks drive groups, groups drive collectives (docs/architecture.md)."""
