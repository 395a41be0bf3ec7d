"""Egeria layer freezing (module list: see the lead's docstring)."""
