"""Keras 3 layers that keep their state on the ps tasks.

`DynamicEmbedding`: an embedding without a vocabulary; any int64 or string
key gets its own row, admitted by frequency and evicted by capacity (least
recently used) or age. See docs/dynamic_embeddings.md.

Importing this module imports Keras (TensorFlow backend).
"""

from psclient._keras.dynamic_embedding import DynamicEmbedding
from psclient._keras.dynamic_optimizers import UnsupportedOptimizerError

__all__ = ["DynamicEmbedding", "UnsupportedOptimizerError"]
