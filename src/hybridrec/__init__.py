"""hybridrec: communication-efficient training of DLRM-class recommendation models."""

__version__ = "0.1.0"
