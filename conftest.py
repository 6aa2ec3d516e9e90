# The repo-wide pytest setup: the multi-rank fixtures from mega-core's testing helpers.
pytest_plugins = ["mega.core.testing.fixtures"]
