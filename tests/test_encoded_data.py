"""The encoded training corpus: per-process parts, cache invalidation and damage, the lazy
epoch permutation, windowed streaming with exact resume, the tokenizer's sample."""

import json
import logging
import os
import threading

import numpy as np
import pytest

from configs import multi30k
from transformer.core.errors import ConfigError
from transformer.data import encoded_corpus
from transformer.data.translation import base as translation
from transformer.data.pipeline import permute
from transformer.data.tokenizer import sample
from transformer.run import experiment
from transformer.run.config import parse

WORDS = ("red", "small", "old", "happy", "dog", "cat", "man", "bird", "tree", "car")
SOURCES = [f"the {a} {b} sees {c} {d}" for a in WORDS[:4] for b in WORDS[4:8]
           for c in ("a", "the") for d in WORDS[8:]]  # 64 distinct sentences


def _corpus(directory, lines=SOURCES):
  os.makedirs(directory, exist_ok=True)
  for name, text in (("train.en", lines), ("train.de", [" ".join(s.split()[::-1]) for s in lines]),
                     ("valid.en", lines[:4]), ("valid.de", lines[:4])):
    with open(os.path.join(directory, name), "w") as f:
      f.write("\n".join(text) + "\n")


def _source(tmp_path, window=16, vocab_size=28, batch_size=4):
  config = multi30k.get_config()
  config.data.update(dir=str(tmp_path / "corpus"), train_source="train.en",
                     train_target="train.de", valid_source="valid.en", valid_target="valid.de",
                     test_source="", test_target="", vocab_size=vocab_size, max_len=40,
                     window=window)
  config.train.batch_size = batch_size
  source = experiment.make_source(parse(config), str(tmp_path / "run"))
  source.prepare()
  return source


def _sentences(source, rows):
  """The source sentences packed in the rows."""
  out = []
  for tokens, segments in zip(rows["inputs"], rows["inputs_segmentation"]):
    out += [source.tokenizer.decode(tokens[segments == s])
            for s in np.unique(segments[segments > 0])]
  return out


def test_permute_is_a_lazy_permutation_per_epoch():
  for n in (1, 2, 5, 64, 1000, 4097):
    assert sorted(permute(np.arange(n), n, seed=0, epoch=3).tolist()) == list(range(n))
  whole = permute(np.arange(1000), 1000, seed=0, epoch=0)
  np.testing.assert_array_equal(permute(np.arange(300, 400), 1000, 0, 0), whole[300:400])
  assert not np.array_equal(whole, permute(np.arange(1000), 1000, 0, 1))
  assert not np.array_equal(whole, permute(np.arange(1000), 1000, 1, 0))


def test_tokenizer_sample_is_bounded_seeded_and_whole_under_the_bound():
  items = [str(i) for i in range(10_000)]
  assert sample(iter(items), 20_000) == items  # Multi30k fits: the same tokenizer as before
  a, b = sample(iter(items), 1000, seed=1), sample(iter(items), 1000, seed=1)
  assert a == b and len(set(a)) == 1000 and a != sample(iter(items), 1000, seed=2)
  assert 4000 < np.mean([int(x) for x in a]) < 6000  # from the whole stream, not its head


def test_two_processes_read_disjoint_parts_that_cover_the_corpus(tmp_path):
  _corpus(tmp_path / "corpus")
  source = _source(tmp_path)
  parts = []
  for index in range(2):
    dataset = source.train_batches(process_index=index, process_count=2)
    assert dataset.num_windows == 2  # 32 pairs each, 16 per window
    epoch = [dataset.rows(0, w) for w in range(dataset.num_windows)]
    parts.append(sum((_sentences(source, rows) for rows in epoch), []))
    stream = iter(dataset)  # the batches are the epoch's rows in order, across windows
    rows = {k: np.concatenate([r[k] for r in epoch]) for k in epoch[0]}
    for start in range(0, len(rows["inputs"]) - 2, 2):  # batch 4 = 2 rows per process
      batch = next(stream)
      for k in rows:
        np.testing.assert_array_equal(batch[k], rows[k][start:start + 2])
  assert len(parts[0]) == len(set(parts[0])) == 32 and len(parts[1]) == 32
  assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == set(SOURCES)


def test_a_changed_corpus_or_tokenizer_rebuilds_the_cache_with_a_log_line(tmp_path, caplog):
  _corpus(tmp_path / "corpus")
  assert len(_source(tmp_path).encoded_corpus()) == 64
  _corpus(tmp_path / "corpus", SOURCES[:40])
  with caplog.at_level(logging.INFO):
    assert len(_source(tmp_path).encoded_corpus()) == 40
  assert "built for another corpus" in caplog.text and "rebuilding it" in caplog.text
  caplog.clear()
  os.remove(tmp_path / "run" / "spm.model")  # retrained with another vocabulary
  with caplog.at_level(logging.INFO):
    _source(tmp_path, vocab_size=26).encoded_corpus()
  assert "built for another tokenizer_sha256; rebuilding it" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    _source(tmp_path, vocab_size=26).encoded_corpus()
  assert "rebuilding" not in caplog.text and "encoding" not in caplog.text  # reused


def test_a_damaged_cache_is_rebuilt_or_refused_never_trained_on(tmp_path, caplog):
  _corpus(tmp_path / "corpus")
  cache = tmp_path / "run" / translation.ENCODED_DIR
  shard = cache / encoded_corpus.shard_name(0)
  want = _sentences(_source(tmp_path), _source(tmp_path).train_batches().rows(0, 0))
  data = shard.read_bytes()
  shard.write_bytes(data[:len(data) // 2])  # truncated: detected by its size, rebuilt
  with caplog.at_level(logging.INFO):
    source = _source(tmp_path)
    assert _sentences(source, source.train_batches().rows(0, 0)) == want
  assert "the manifest says" in caplog.text and "rebuilding" in caplog.text
  (cache / encoded_corpus.MANIFEST).write_text("{not json")  # unreadable manifest: rebuilt
  assert len(_source(tmp_path).encoded_corpus()) == 64
  intact = shard.read_bytes()
  damaged = bytearray(intact)  # same size, a block header's byte flipped: opening it fails
  damaged[len(intact) // 2] ^= 0xFF
  shard.write_bytes(bytes(damaged))
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert len(_source(tmp_path).encoded_corpus()) == 64
  assert "is damaged" in caplog.text and "rebuilding it" in caplog.text
  assert shard.read_bytes() == intact
  damaged = bytearray(intact)  # a record's byte flipped: found only when read, refused
  damaged[100] ^= 0xFF
  shard.write_bytes(bytes(damaged))
  with pytest.raises(ConfigError, match="encoded corpus at .* is damaged .* delete"):
    dataset = _source(tmp_path).train_batches()
    for window in range(dataset.num_windows):
      dataset.rows(0, window)
  manifest = json.loads((cache / encoded_corpus.MANIFEST).read_text())
  assert manifest["records"] == 64 and manifest["shards"][0]["bytes"] == len(damaged)


def _set(manifest, field, value):
  if field == "records":
    manifest["records"] = value
  elif field == "dtype":
    manifest["dtype"] = value
  elif field == "bytes":
    manifest["shards"][0]["bytes"] = value
  elif field == "shard_records":  # a shard's count, and the total to agree with it
    manifest["shards"][0]["records"] = manifest["records"] = value
  else:
    manifest[field] = value


# (edit, value, re-signed: the checksum recomputed, as an edit by code would, the reason
# logged). Unsigned, every edit is caught by the checksum; re-signed, by the shards.
MANIFEST_EDITS = [
    ("records", 100, False, "checksum does not match"),
    ("records", 40000, False, "checksum does not match"),
    ("dtype", "int32", False, "checksum does not match"),
    ("checksum", "0" * 64, False, "checksum does not match"),
    ("records", 100, True, "says 100 records, its shards' counts add up to 64"),
    ("records", 40000, True, "says 40000 records"),
    ("dtype", "int32", True, "dtype 'int32', this vocabulary's records are uint16"),
    ("dtype", "float64", True, "dtype 'float64'"),
    ("bytes", 1000, True, "the manifest says 1000"),
    ("shard_records", 30, True, "holds 64 records, the manifest says 30"),
]


@pytest.mark.parametrize("field,value,signed,why", MANIFEST_EDITS,
                         ids=[f"{f}={v}{' signed' if s else ''}" for f, v, s, _ in MANIFEST_EDITS])
def test_a_manifest_that_disagrees_with_itself_or_its_shards_is_rebuilt(
    tmp_path, caplog, field, value, signed, why):
  _corpus(tmp_path / "corpus")
  want = _sentences(_source(tmp_path), _source(tmp_path).train_batches().rows(0, 0))
  path = tmp_path / "run" / translation.ENCODED_DIR / encoded_corpus.MANIFEST
  manifest = json.loads(path.read_text())
  _set(manifest, field, value)
  if signed:
    manifest["checksum"] = encoded_corpus.checksum(manifest)
  path.write_text(json.dumps(manifest))
  with caplog.at_level(logging.INFO):
    source = _source(tmp_path)
    assert len(source.encoded_corpus()) == 64  # never a smaller corpus, never a traceback
    assert _sentences(source, source.train_batches().rows(0, 0)) == want
  assert why in caplog.text and "rebuilding it" in caplog.text, caplog.text
  rebuilt = json.loads(path.read_text())
  assert rebuilt["records"] == 64 and rebuilt["checksum"] == encoded_corpus.checksum(rebuilt)


def test_a_disagreeing_cache_that_cannot_be_rebuilt_is_refused_in_one_line(tmp_path,
                                                                          monkeypatch):
  _corpus(tmp_path / "corpus")
  _source(tmp_path).encoded_corpus()
  cache = tmp_path / "run" / translation.ENCODED_DIR
  manifest = json.loads((cache / encoded_corpus.MANIFEST).read_text())
  (cache / encoded_corpus.MANIFEST).write_text(json.dumps(manifest | {"records": 100}))
  monkeypatch.setattr(encoded_corpus.storage, "writable_directory",
                      lambda path: f"{path} is not writable")  # a shared read-only cache
  with pytest.raises(ConfigError) as error:
    _source(tmp_path).encoded_corpus()
  message = str(error.value)
  assert "\n" not in message and str(cache) in message and "checksum" in message
  assert "cannot be built there" in message and "data.cache_dir" in message


def test_shards_and_manifest_have_the_same_permissions(tmp_path):
  old = os.umask(0o022)
  try:
    _corpus(tmp_path / "corpus")
    _source(tmp_path).encoded_corpus()
  finally:
    os.umask(old)
  cache = tmp_path / "run" / translation.ENCODED_DIR
  modes = {p.name: p.stat().st_mode & 0o777 for p in cache.iterdir()}
  assert set(modes.values()) == {0o644}, modes


def test_a_corpus_error_while_encoding_leaves_no_shards(tmp_path):
  pairs = [(f"s{i}", f"t{i}") for i in range(40)]

  def failing():
    yield from pairs
    raise ConfigError("train.en:41: not valid UTF-8")
  encode = lambda sentences: [[5] * len(s) for s in sentences]  # noqa: E731
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(encoded_corpus, "CHUNK", 16)  # two shards written before the error
    with pytest.raises(ConfigError, match="not valid UTF-8"):
      encoded_corpus.build(str(tmp_path / "cache"), {"k": 1}, failing(), encode, 100)
  assert not (tmp_path / "cache").exists()


def test_resume_mid_window_and_across_epochs_gives_identical_batches(tmp_path):
  _corpus(tmp_path / "corpus")
  dataset = _source(tmp_path, window=24, batch_size=3).train_batches()  # windows 24, 24, 16
  it = iter(dataset)
  states, batches = [], []
  for _ in range(40):  # several epochs of ~25 rows
    states.append(it.get_state())
    batches.append(next(it))
  assert {s["epoch"] for s in states} >= {0, 1, 2} and {s["window"] for s in states} == {0, 1, 2}
  for k in (5, 9, 17, 31):
    resumed = iter(dataset)
    resumed.set_state(states[k])
    for want in batches[k:k + 6]:
      got = next(resumed)
      for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_two_processes_share_the_encoding_and_wait_only_for_each_other(tmp_path, monkeypatch):
  monkeypatch.setattr(encoded_corpus, "CHUNK", 16)  # 64 pairs: 4 chunks, 2 per process
  barrier, results, encoders = threading.Barrier(2, timeout=60), [None, None], [set(), set()]
  pairs = [(s, s.upper()) for s in SOURCES]

  def process(index):
    def encode(sentences):
      encoders[index].update(sentences)
      return [[4 + len(w) for w in s.split()] for s in sentences]
    results[index] = encoded_corpus.build(str(tmp_path / "cache"), {"k": 1}, iter(pairs),
                                          encode, 100, index, 2,
                                          barrier=lambda name: barrier.wait())
  threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
  [t.start() for t in threads], [t.join() for t in threads]
  assert results[0] == results[1] and results[0]["records"] == 64
  assert [s["records"] for s in results[0]["shards"]] == [16] * 4
  assert not encoders[0] & encoders[1]  # each encoded its own chunks: 0 and 2, 1 and 3
  assert encoders[0] | encoders[1] == {s for pair in pairs for s in pair}
  corpus = encoded_corpus.EncodedCorpus(str(tmp_path / "cache"), results[0])
  tokens, starts, lengths = corpus.read(np.array([63, 0, 17]))
  for k, (source, target) in enumerate((pairs[63], pairs[0], pairs[17])):
    want = [4 + len(w) for w in source.split()] + [2]
    assert tokens[starts[k, 0]:starts[k, 0] + lengths[k, 0]].tolist() == want
    assert lengths[k, 1] == len(target.split()) + 1
