"""transformers' own cache and generation tests, run as they are and with hfkv's TriStateCache in DynamicCache's place.

``upstream/`` holds the vendored test files (``upstream/SOURCE.md``: version, provenance, licence), ``plugin.py`` the
pytest plugin that substitutes and records, ``run.py`` the runner, ``compare.py`` the summary. README.md tells how.
"""
