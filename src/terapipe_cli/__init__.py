"""terapipe: plan and launch token-level pipeline-parallel training (TeraPipe)."""

__version__ = "0.1.0"
