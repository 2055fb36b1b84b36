"""The data-source registry: `config.data.source` names one of SOURCES. Every entry meets
data.base.DataSource; tests/test_sources.py checks each against it."""

from transformer.data.base import DataSource
from transformer.data.lm import LanguageModelSource, MQARSource
from transformer.data.tasks import AlgorithmicSource, LabelledSource, SyntheticSource
from transformer.data.translation import HfSource, ParallelTextSource, TfdsSource

SOURCES: dict[str, type[DataSource]] = {
    "synthetic": SyntheticSource,  # a generated task over held-out strings, seq2seq
    "text": ParallelTextSource,  # parallel text files (translation)
    "tfds": TfdsSource,  # a prepared TFDS translation dataset
    "hf": HfSource,  # a Hugging Face dataset's translation pairs (hub or local files)
    "labelled": LabelledSource,  # a generated task labelled by an encoder (ListOps, duplicates)
    "lm": LanguageModelSource,  # long documents (a causal language model)
    "algorithmic": AlgorithmicSource,  # a generated task, the papers' length protocol
    "mqar": MQARSource,  # multi-query associative recall (Zoology), a causal language model
}
