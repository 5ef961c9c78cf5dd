"""The package version (read by setup.py; a leaf module, so that modules of the package can
import it without importing the package front)."""
__version__ = "0.1.0"
