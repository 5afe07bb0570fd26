"""evalsvc: accuracy and KL-divergence evaluation of SGLang's Mamba-hybrid serving paths."""

__version__ = "0.1.0"
