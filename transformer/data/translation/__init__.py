"""Translation data: what every translation source shares (base.py: the vocabulary, the
encoded pairs, the splits) and the sources of pairs: parallel text files (text.py), a
prepared TFDS dataset (tfds.py), a Hugging Face dataset (hf.py). The rest of the package
enters here."""

from transformer.data.translation.hf import HfSource
from transformer.data.translation.text import ParallelTextSource
from transformer.data.translation.tfds import TfdsSource

__all__ = ["HfSource", "ParallelTextSource", "TfdsSource"]
