"""Language-modelling data for the decoder-only family: long documents cut into windows
(source.py, from the corpora of corpora.py), passkey retrieval (passkey.py: its evaluation,
and its rows in training batches) and multi-query associative recall (mqar.py). The rest of
the package enters here."""

from transformer.data.lm.mqar import MQARSource
from transformer.data.lm.source import LanguageModelSource

__all__ = ["LanguageModelSource", "MQARSource"]
