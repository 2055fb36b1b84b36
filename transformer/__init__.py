"""Transformer ablations in JAX/Flax NNX, in five wings, each importing only from the ones
before it (tests/test_layout.py holds the rule):

  core   the base every wing uses: errors, typed config fields, registries, storage, vocab, metrics
  data   data sources: generated tasks (one seam: task, splits rule, cast), text, TFDS,
         Hugging Face, LM corpora
  model  pure model code: layers, attention, scorers, kernels, positional encodings, families,
         decoding
  run    wiring and running: the typed config, the experiment, the train step and loop,
         evaluation, checkpoints, workdirs, logs, trackers, sharding
  study  many runs: sweeps, results, reports and plots, statistics, comparison, pictures

and, above them, transformer/api.py: what config and sweep files import (the public surface).
"""
