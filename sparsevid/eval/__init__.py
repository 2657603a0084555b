"""Quality metrics for sparse attention: mask recall and output error against dense attention."""
from .metrics import attention_recall, cosine_similarity, relative_l1, sparse_output_error

__all__ = ["attention_recall", "cosine_similarity", "relative_l1", "sparse_output_error"]
