# The one place the version of every mega distribution is declared.
# Each package's pyproject.toml reads it through hatchling's version source.
__version__ = "0.1.0"
