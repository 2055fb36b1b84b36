"""Parallel text files, the sentencepiece tokenizer and the packing/shuffling pipeline."""

import gzip
import os

import numpy as np
import pytest

from tests.support import implied_structure
from transformer.core.errors import ConfigError
from transformer.core.vocab import BOS_ID, EOS_ID, PAD_ID
from transformer.data import pipeline
from transformer.data.pipeline import PackedStream
from transformer.data.text_files import read_parallel
from transformer.data.tokenizer import Tokenizer, train_tokenizer

MULTI30K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "multi30k")
SENTENCES = [f"the {a} {n} sees {b} {m}" for a in ("red", "small", "old", "happy")
             for n in ("dog", "cat", "man", "bird") for b in ("a", "the") for m in ("tree", "car")]


class Pairs:
  """In-memory (source ids, target ids) examples with the random-access `read` of
  encoded_corpus.EncodedCorpus, which PackedStream packs."""

  def __init__(self, examples):
    lengths = np.array([(len(s), len(t)) for s, t in examples], np.int64).reshape(-1, 2)
    self.lengths = lengths
    self.starts = (np.cumsum(lengths.reshape(-1)) - lengths.reshape(-1)).reshape(-1, 2)
    self.tokens = np.concatenate([np.asarray(x, np.int32) for ex in examples for x in ex])

  def __len__(self) -> int:
    return len(self.lengths)

  def read(self, indices: np.ndarray):
    return self.tokens, self.starts[indices], self.lengths[indices]


def train_batches(examples, *, seed, batch_size, max_len, pack=True, window=8192):
  """Endless packed (or padded) batches of in-memory examples, as a one-process run reads."""
  return PackedStream(Pairs(examples), seed=seed, batch_size=batch_size, max_len=max_len,
                      pack=pack, window=window, process_index=0, process_count=1)


def _write(path, lines, gz=False, raw=None):
  data = raw if raw is not None else ("\n".join(lines) + "\n").encode()
  with (gzip.open if gz else open)(path, "wb") as f:
    f.write(data)
  return str(path)


def test_reads_plain_and_gzip(tmp_path):
  src = _write(tmp_path / "a.en", ["one", "two"])
  tgt = _write(tmp_path / "a.de.gz", ["eins", "zwei"], gz=True)
  assert read_parallel(src, tgt) == [("one", "eins"), ("two", "zwei")]


def test_corpus_errors_name_the_file_and_line(tmp_path):
  good = _write(tmp_path / "good", ["a", "b"])
  with pytest.raises(ConfigError, match="corpus file not found: .*missing"):
    read_parallel(str(tmp_path / "missing"), good)
  short = _write(tmp_path / "short", ["a"])
  with pytest.raises(ConfigError, match="has 2 lines but .*short has 1"):
    read_parallel(good, short)
  empty = _write(tmp_path / "empty", [], raw=b"")
  with pytest.raises(ConfigError, match="empty corpus"):
    read_parallel(empty, _write(tmp_path / "empty2", [], raw=b""))
  bad = _write(tmp_path / "bad", [], raw=b"fine\nbroken \xff byte\n")
  with pytest.raises(ConfigError, match=r"bad:2: not valid UTF-8"):
    read_parallel(bad, good)


def test_tokenizer_round_trips_and_uses_reserved_ids(tmp_path):
  tok = train_tokenizer(SENTENCES, str(tmp_path / "spm.model"), vocab_size=28)
  assert tok.vocab_size == 28
  for s in SENTENCES[:10] + ["a dog sees the bird"]:
    ids = tok.encode(s)
    assert ids[-1] == EOS_ID and not np.isin(ids[:-1], [PAD_ID, BOS_ID, EOS_ID]).any()
    assert tok.decode(ids) == s
    assert tok.decode(np.concatenate([[BOS_ID], ids, [PAD_ID, 7]])) == s  # stops at EOS
  assert Tokenizer(tok.path).encode("the cat").tolist() == tok.encode("the cat").tolist()


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ConfigError, match="unknown tokenizer type 'wordpiece'"):
    train_tokenizer(SENTENCES, str(tmp_path / "x.model"), 28, model_type="wordpiece")
  with pytest.raises(ConfigError, match="sentencepiece training failed"):
    train_tokenizer(SENTENCES, str(tmp_path / "x.model"), 100000)
  assert not (tmp_path / "x.model").exists()
  with pytest.raises(ConfigError, match="sentencepiece model not found"):
    Tokenizer(str(tmp_path / "none.model"))


def _examples(n=40, seed=0):
  rng = np.random.default_rng(seed)
  pairs = []
  for i in range(n):  # token 3+i marks example i on both sides
    src = np.concatenate([[3 + i], rng.integers(100, 200, rng.integers(0, 6)), [EOS_ID]])
    tgt = np.concatenate([[3 + i], rng.integers(200, 300, rng.integers(0, 7)), [EOS_ID]])
    pairs.append((src.astype(np.int32), tgt.astype(np.int32)))
  return pairs


def _segments(row, key):
  seg, pos, tok = row[f"{key}_segmentation"], row[f"{key}_positions"], row[key]
  return {s: (tok[seg == s], pos[seg == s]) for s in np.unique(seg[seg > 0])}


def test_packing_never_mixes_segments():
  pairs = _examples()
  by_marker = {int(src[0]): (src, tgt) for src, tgt in pairs}
  it = iter(train_batches(pairs, seed=0, batch_size=4, max_len=12))
  seen, rows = set(), 0
  for _ in range(10):
    batch = next(it)
    assert batch["inputs"].shape == (4, 12)
    for r in range(4):
      row = {k: v[r] for k, v in batch.items()}
      inputs, targets = _segments(row, "inputs"), _segments(row, "targets")
      assert inputs.keys() == targets.keys()
      rows += 1
      for s in inputs:
        (src, src_pos), (tgt, tgt_pos) = inputs[s], targets[s]
        want_src, want_tgt = by_marker[int(src[0])]
        np.testing.assert_array_equal(src, want_src)  # whole pair, in one segment
        np.testing.assert_array_equal(tgt, want_tgt)
        np.testing.assert_array_equal(src_pos, np.arange(len(src)))  # positions restart
        np.testing.assert_array_equal(tgt_pos, np.arange(len(tgt)))
        seen.add(int(src[0]))
      for key in ("inputs", "targets"):
        assert np.all(row[key][row[f"{key}_segmentation"] == 0] == PAD_ID)
  assert len(seen) == 40  # every example appears; several share rows
  assert sum(len(_segments({k: v[0] for k, v in next(it).items()}, "inputs")) > 1
             for _ in range(5)) > 0


def test_unpacked_rows_hold_one_pair_and_long_pairs_are_dropped():
  pairs = _examples() + [(np.arange(3, 30, dtype=np.int32), np.array([5, EOS_ID], np.int32))]
  it = iter(train_batches(pairs, seed=0, batch_size=8, max_len=12,
                          pack=False))
  for _ in range(12):
    batch = next(it)
    assert sorted(batch) == ["inputs", "targets"]  # no segment ids: one pair per row
    for key in ("inputs", "targets"):
      real = batch[key] != PAD_ID
      assert real[:, 0].all() and (real[:, :-1] >= real[:, 1:]).all()  # from slot 0
    assert batch["inputs"].shape == (8, 12)


def test_unpacked_rows_leave_out_the_segment_ids_and_positions_they_imply(monkeypatch):
  rows = lambda: next(iter(train_batches(_examples(), seed=0, batch_size=8,  # noqa: E731
                                         max_len=12, pack=False)))
  batch = rows()
  monkeypatch.setattr(pipeline, "unpacked", lambda arrays: arrays)  # the rows as filled
  whole, implied = rows(), implied_structure(batch)
  assert implied.keys() == whole.keys()
  for key in whole:
    np.testing.assert_array_equal(implied[key], whole[key], err_msg=key)


@pytest.mark.parametrize("pack", [True, False])
def test_restored_iterator_continues_the_exact_stream(pack):
  ds = train_batches(_examples(), seed=3, batch_size=4, max_len=12,
                     pack=pack)
  it = iter(ds)
  for _ in range(7):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(15)]  # crosses epoch boundaries (reshuffled)
  resumed = iter(ds)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k is absent")
def test_multi30k_reads_and_its_vocabulary_round_trips(tmp_path):
  pairs = read_parallel(os.path.join(MULTI30K, "val.en.gz"), os.path.join(MULTI30K, "val.de.gz"))
  assert len(pairs) == 1014
  tok = train_tokenizer((s for p in pairs for s in p), str(tmp_path / "m.model"), 2000)
  for en, de in pairs[:50]:
    assert tok.decode(tok.encode(en)) == en and tok.decode(tok.encode(de)) == de


def test_lm_token_bound_holds_for_any_tokenizer(tmp_path):
  """lm.max_tokens (the held-out check at construction) is never below the tokens
  encode_documents gives, whatever the tokenizer type, normalization or byte fallback, on
  text that a normalizer expands (ligatures), shrinks (combining marks), or that has runs
  of spaces, empty lines and characters the tokenizer never saw."""
  import sentencepiece as spm  # noqa: PLC0415

  from transformer.data.lm.source import encode_documents, max_tokens  # noqa: PLC0415
  from transformer.data.tokenizer import train_model  # noqa: PLC0415

  documents = ["def f(x):\n    return x\n\n", "ﬁne ﬂow ﬀ ① ㎏ ﷺ", "e\u0301 a\u0308 İstanbul ß",
               "", "\n\n\n", "  many   spaces  \t tabs", "日本語のテキスト 🙂 ~^~", "x"]
  protos = [train_model(SENTENCES, 28, kind) for kind in ("unigram", "bpe", "char")]
  for rule in ("identity", "nfkc_cf"):  # a given tokenizer may normalize otherwise
    model = tmp_path / f"{rule}.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_prefix=str(model)[:-6], vocab_size=280,
        normalization_rule_name=rule, byte_fallback=True, pad_id=PAD_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, unk_id=3, minloglevel=2)
    protos.append(model.read_bytes())
  for proto in protos:
    tokenizer = Tokenizer("in memory", proto)
    for doc in documents:
      assert len(encode_documents(tokenizer, [doc])) <= max_tokens([doc]), doc
    assert len(encode_documents(tokenizer, documents)) <= max_tokens(documents)


def test_process_0_trains_the_tokenizer_and_the_others_receive_it(tmp_path, monkeypatch):
  """Two processes as threads: process 0 alone reads the corpus and trains (in memory,
  nothing written); process 1 gets its bytes; an error on process 0 fails both, no hang."""
  import threading  # noqa: PLC0415

  from transformer.data import tokenizer as tokenizer_lib  # noqa: PLC0415

  local, barrier, slot = threading.local(), threading.Barrier(2, timeout=60), {}

  def broadcast(value):
    if local.index == 0:
      slot["value"] = np.array(value)
    barrier.wait()
    received = np.array(slot["value"])
    barrier.wait()
    return received
  monkeypatch.setattr(tokenizer_lib.jax, "process_index", lambda: local.index)
  monkeypatch.setattr(tokenizer_lib.jax, "process_count", lambda: 2)
  monkeypatch.setattr(tokenizer_lib.multihost_utils, "broadcast_one_to_all", broadcast)

  def both(sentences):
    results, read = [None, None], [0, 0]

    def process(index):
      local.index = index

      def corpus():
        read[index] += 1
        yield from sentences()
      try:
        results[index] = tokenizer_lib.load_or_train(
            str(tmp_path / "spm.model"), corpus, tokenizer_lib.Recipe([], 28, "unigram"))
      except ConfigError as e:
        results[index] = e
    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    [t.start() for t in threads], [t.join(60) for t in threads]
    return results, read

  (first, second), read = both(lambda: iter(SENTENCES))
  assert read == [1, 0] and first.proto == second.proto and second.vocab_size == 28
  assert first.unsaved is not None and not list(tmp_path.iterdir())

  def bad():
    yield from SENTENCES[:5]
    raise ConfigError("train.en:6: not valid UTF-8")
  (first, second), _ = both(bad)
  assert isinstance(first, ConfigError) and "not valid UTF-8" in str(first)
  assert isinstance(second, ConfigError) and "process 0 could not" in str(second)
