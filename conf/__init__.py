"""The config tree, packaged as rlexp.conf (pyproject.toml: package-dir), so that Hydra reads it
as pkg://rlexp.conf from a wheel as well as from this checkout."""
