"""kforge's version: the one place it is written (setup.py reads this file, kforge.__version__ imports it)."""
__version__ = "0.1.0"
