"""Quality metrics: mask recall and output error against dense attention, caption faithfulness of clips."""
from .faithfulness import faithfulness
from .metrics import attention_recall, cosine_similarity, relative_l1, sparse_output_error

__all__ = ["attention_recall", "cosine_similarity", "faithfulness", "relative_l1", "sparse_output_error"]
