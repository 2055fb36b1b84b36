"""Hugging Face datasets as a data source (data.source=hf, data.corpus=hf), on parquet, JSON
Lines and arrow files the tests write (no network: conftest sets HF_HUB_OFFLINE and a
session HF_HOME): the rows read back as written, the same token ids as the text and files
sources on the same sentences, streaming = preparing, a changed file rebuilds the encoded
cache, a run trains and evaluates, and bad input fails in one ConfigError naming the field."""

import json
import os
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
import pyarrow as pa  # noqa: E402 - datasets' own dependency
import pyarrow.parquet as pq  # noqa: E402

from tests.support import make_tiny_config  # noqa: E402
from transformer.core import fields
from transformer.core.errors import ConfigError  # noqa: E402
from transformer.data import encoded_corpus, hf_datasets  # noqa: E402
from transformer.data.translation.hf import HfData  # noqa: E402
from transformer.data.lm.source import LMData  # noqa: E402
from transformer.run import config as config_lib  # noqa: E402
from transformer.run import experiment
from transformer.run.config import parse  # noqa: E402
from transformer.run.training import train_and_evaluate  # noqa: E402

WORDS = ["a", "dog", "cat", "runs", "sleeps", "the", "big", "small", "here", "now"]
EN = [f"{a} {b} {c}" for a in WORDS[:5] for b in WORDS[5:] for c in WORDS[::4]]  # 75
DE = [s.upper() + " ja" for s in EN]


def write(path, rows, fmt):
  """Rows (dicts) as a parquet, JSON Lines or arrow (IPC stream, as datasets writes) file."""
  if fmt == "parquet":
    pq.write_table(pa.Table.from_pylist(rows), path)
  elif fmt == "json":
    with open(path, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
  else:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
      writer.write_table(table)


def rows_of(en, de, nested=True):
  return [{"translation": {"en": s, "de": t}, "id": i} if nested else {"src": s, "tgt": t}
          for i, (s, t) in enumerate(zip(en, de))]


def corpus(directory, fmt="parquet", nested=True, train=(EN, DE), valid=(EN[:6], DE[:6])):
  """Train and valid files in `directory`; returns config.data overrides reading them."""
  ext = {"json": "jsonl"}.get(fmt, fmt)
  os.makedirs(directory, exist_ok=True)
  for split, (en, de) in (("train", train), ("valid", valid)):
    write(os.path.join(directory, f"{split}.{ext}"), rows_of(en, de, nested), fmt)
  columns = (dict(source_column="translation.en", target_column="translation.de") if nested
             else dict(source_column="src", target_column="tgt"))
  return dict(hf_path=fmt, dir=str(directory), train_files=f"train.{ext}",
              valid_files=f"valid.{ext}", test_split="", **columns)


def config(**data):
  """A tiny translation run's config with config.data an HfData of `data`."""
  raw = make_tiny_config(**{"train.batch_size": 8, "train.num_steps": 4,
                            "train.checkpoint_every": 4, "train.log_every": 2,
                            "eval.num_examples": 0, "eval.batch_size": 8}).to_dict()
  raw["data"] = fields.to_dict(HfData(**{"source": "hf", "vocab_size": 48, "max_len": 16,
                                         "decode_offset": 3, **data}))
  del raw["task"]
  return parse(raw)


def source_of(cfg, workdir=None):
  return experiment.make_source(cfg, workdir and str(workdir))


def records(source) -> list[tuple[str, str]]:
  """The encoded training corpus' pairs, decoded by the source's tokenizer."""
  corpus = source.encoded_corpus()
  tokens, starts, lengths = corpus.read(np.arange(len(corpus)))
  return [tuple(source.tokenizer.decode(tokens[s:s + n]) for s, n in zip(start, length))
          for start, length in zip(starts, lengths)]


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_rows_read_back_as_written(tmp_path, fmt, nested):
  source = source_of(config(**corpus(tmp_path / "data", fmt, nested)))
  assert list(source.train_pairs()) == list(zip(EN, DE))  # in file order
  assert source.pairs("valid") == list(zip(EN[:6], DE[:6]))
  assert source.held_out() == ["valid"]


def test_the_same_ids_as_the_text_source(tmp_path):
  """The same sentences as text files and as parquet: the same tokenizer (trained on the
  same sample), encoded corpus and held-out arrays; the corpus decodes back to the text."""
  text_dir = tmp_path / "text"
  text_dir.mkdir()
  for split, en, de in (("train", EN, DE), ("valid", EN[:6], DE[:6])):
    (text_dir / f"{split}.en").write_text("\n".join(en) + "\n")
    (text_dir / f"{split}.de").write_text("\n".join(de) + "\n")
  hf_cfg = config(**corpus(tmp_path / "hf"))
  text_raw = config_lib.to_dict(hf_cfg)
  text_raw["data"] = dict(source="text", dir=str(text_dir), train_source="train.en",
                          train_target="train.de", valid_source="valid.en",
                          valid_target="valid.de", vocab_size=48, max_len=16, decode_offset=3)
  hf, text = source_of(hf_cfg, tmp_path / "run_hf"), source_of(parse(text_raw),
                                                               tmp_path / "run_text")
  hf.prepare()
  text.prepare()
  assert hf.tokenizer.proto == text.tokenizer.proto
  assert records(hf) == records(text) == list(zip(EN, DE))
  a, b = hf.eval_splits()["valid"], text.eval_splits()["valid"]
  assert a.references == b.references == DE[:6]
  for key in a.arrays:
    np.testing.assert_array_equal(a.arrays[key], b.arrays[key])


def test_streaming_reads_what_preparing_reads(tmp_path):
  data = corpus(tmp_path / "data", "json")
  prepared = source_of(config(**data), tmp_path / "prepared")
  streamed = source_of(config(**data, hf_streaming=True), tmp_path / "streamed")
  assert isinstance(streamed.datasets["train"], datasets.IterableDataset)
  assert isinstance(prepared.datasets["train"], datasets.Dataset)
  assert list(streamed.train_pairs()) == list(prepared.train_pairs())
  assert streamed.pairs("valid") == prepared.pairs("valid")
  assert streamed.corpus_identity() == prepared.corpus_identity()  # an execution choice
  prepared.prepare()
  streamed.prepare()
  assert records(streamed) == records(prepared) == list(zip(EN, DE))


def test_a_changed_file_rebuilds_the_encoded_cache(tmp_path):
  """The cache key holds the files' sizes and mtimes: rewritten, the corpus is encoded
  again (with the same tokenizer) and the run reads the new pairs, never the old ones."""
  data = corpus(tmp_path / "data")
  first = source_of(config(**data), tmp_path / "run")
  first.prepare()
  assert records(first) == list(zip(EN, DE))
  before = first.corpus_identity()
  shuffled = list(zip(EN[::-1], DE))
  write(tmp_path / "data" / "train.parquet", rows_of(*zip(*shuffled)), "parquet")
  stat = os.stat(tmp_path / "data" / "train.parquet")
  os.utime(tmp_path / "data" / "train.parquet", (stat.st_atime, stat.st_mtime + 5))
  again = source_of(config(**data, tokenizer=str(tmp_path / "run" / "spm.model"),
                           cache_dir=str(tmp_path / "run")), tmp_path / "run")
  assert again.corpus_identity() != before
  again.load()
  key = encoded_corpus.make_key(again.tokenizer.proto, again.corpus_identity())
  assert encoded_corpus.check(again.cache_dir, key, np.uint16) is None  # stale: to be rebuilt
  again.prepare()
  assert records(again) == shuffled


def _hub_layout(directory, en_train=EN):
  """A local directory laid out like a hub dataset: splits named by the files."""
  os.makedirs(directory, exist_ok=True)
  for name, (en, de) in (("train-00000-of-00001", (en_train, DE)),
                         ("validation-00000-of-00001", (EN[:5], DE[:5])),
                         ("test-00000-of-00001", (EN[5:9], DE[5:9]))):
    write(os.path.join(directory, f"{name}.parquet"), rows_of(en, de), "parquet")
  return dict(hf_path=str(directory), hf_name="")


def test_a_hub_layout_reads_its_splits_and_hashes_its_files(tmp_path):
  data = _hub_layout(tmp_path / "hub")
  source = source_of(config(**data))
  assert source.held_out() == ["valid", "test"]
  assert source.pairs("test") == list(zip(EN[5:9], DE[5:9]))
  identity = source.corpus_identity()
  assert identity[0]["split"] == "train" and identity[0]["hash"]
  _hub_layout(tmp_path / "hub", EN[::-1])
  os.utime(tmp_path / "hub" / "train-00000-of-00001.parquet", (1, 2_000_000_000))
  changed = source_of(config(**data))
  assert changed.corpus_identity() != identity
  assert next(iter(changed.train_pairs())) == (EN[-1], DE[0])
  assert [split for split in source_of(config(**data, test_split="")).held_out()] == ["valid"]


def test_the_lm_corpus_gives_the_files_corpus_streams(tmp_path):
  """data.corpus=hf, one document per row, against data.corpus=files, one per file: the same
  documents give the same tokenizer and token streams."""
  docs = {split: [f"def f{i}(x):\n  return x * {i % 7} + {n}" for i in range(n)]
          for split, n in (("train", 120), ("valid", 40))}
  files = tmp_path / "files"
  for split, documents in docs.items():
    for i, doc in enumerate(documents):
      (files / split).mkdir(parents=True, exist_ok=True)
      (files / split / f"{i:04d}.py").write_text(doc)
    write(tmp_path / f"{split}.jsonl", [{"body": {"text": d}} for d in documents], "json")

  def lm(**data):
    raw = make_tiny_config(**{"eval.num_examples": 2}).to_dict()
    raw["data"] = fields.to_dict(LMData(vocab_size=64, max_len=16, max_factor=2, **data))
    raw["model"]["arch"] = "decoder"
    del raw["task"]
    return experiment.make_source(parse(raw))

  by_rows = lm(corpus="hf", hf_path="json", dir=str(tmp_path), train_files="train.jsonl",
               valid_files="valid.jsonl", text_key="body.text")
  by_files = lm(corpus="files", dir=str(files), train_files="train/*.py",
                valid_files="valid/*.py")
  assert by_rows.valid_documents == by_files.valid_documents == docs["valid"]
  by_rows.load()
  by_files.load()
  assert by_rows.tokenizer.proto == by_files.tokenizer.proto
  for split in ("train", "valid"):
    np.testing.assert_array_equal(by_rows.streams[split], by_files.streams[split])
  with pytest.raises(ConfigError, match=r"text_key='text': no such column .* body\.text"):
    lm(corpus="hf", hf_path="json", dir=str(tmp_path), train_files="train.jsonl",
       valid_files="valid.jsonl")


def test_a_streamed_run_trains_and_evaluates_with_a_test_split(tmp_path):
  data = corpus(tmp_path / "data")
  write(tmp_path / "data" / "test.parquet", rows_of(EN[6:10], DE[6:10]), "parquet")
  cfg = config(**{**data, "test_files": "test.parquet", "hf_streaming": True})
  workdir = tmp_path / "run"
  assert train_and_evaluate(cfg, str(workdir)) == 4
  lines = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  final = {line.get("split"): line for line in lines if "bleu" in line}
  assert {"valid", "test"} <= set(final)


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_one_config_error_naming_the_field(tmp_path):
  data = corpus(tmp_path / "data")
  cases = [
      (dict(source_column="translation.fr"),
       r"source_column='translation.fr': no such column in .*; its columns: translation.en, "
       r"translation.de, id"),
      (dict(target_column="id"), r"target_column='id' is not a text column"),
      (dict(train_files="nope.parquet"), r"train_files='nope.parquet': no file matches"),
      (dict(hf_path="wmt/wmt14"), r"hf_path='wmt/wmt14' is not allowed; it must be one of "
                                  r"arrow, csv, json, parquet"),
      (dict(valid_files=""), r"valid_files='' is not allowed"),
      (dict(source_column=""), r"source_column='' is not allowed"),
  ]
  for overrides, message in cases:
    with pytest.raises(ConfigError, match=message):
      source_of(config(**{**data, **overrides}))
  hub = _hub_layout(tmp_path / "hub")
  with pytest.raises(ConfigError, match=r"valid_split='dev': cannot read .* split 'dev' .*"
                                        r"'train', 'validation', 'test'"):
    source_of(config(**hub, valid_split="dev"))
  with pytest.raises(ConfigError, match=r"train_files='' is not allowed; it must be a glob "
                                        r"under data.dir when data.hf_path='parquet'"):
    config(hf_path="parquet")
  with pytest.raises(ConfigError, match=r"hf_path='' is not allowed"):
    LMData(corpus="hf")


def test_nulls_are_refused_with_their_row(tmp_path):
  data = corpus(tmp_path / "data")
  rows = rows_of(EN, DE)
  rows[3]["translation"]["de"] = None
  write(tmp_path / "data" / "train.parquet", rows, "parquet")
  source = source_of(config(**data))
  with pytest.raises(ConfigError, match=r"row 3: column 'translation.de' holds None, not text"):
    list(source.train_pairs())


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch):
  data = corpus(tmp_path / "data")
  monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
  with pytest.raises(ConfigError, match=r"data.source 'hf' needs the Hugging Face datasets "
                                        r"library: pip install -e '.\[hf\]'"):
    source_of(config(**data))


def test_an_lm_field_on_the_translation_source_says_where_it_belongs():
  with pytest.raises(ConfigError, match=r"unknown field\(s\) text_key in config.data; .*"
                                        r"data.source=lm with data.corpus=hf"):
    fields.dataclass_from(HfData, {"source": "hf", "text_key": "text"}, "data")


def test_columns_of_translation_features_and_of_unknown_features():
  """The hub's WMT datasets declare a Translation feature; a streamed dataset may declare
  none (its columns are then read off the first row): both give the same column paths."""
  features = datasets.Features({"translation": datasets.Translation(languages=["de", "en"]),
                                "n": datasets.Value("int32")})
  rows = {"translation": [{"de": t, "en": s} for s, t in zip(EN[:4], DE[:4])], "n": [1] * 4}
  declared = datasets.Dataset.from_dict(rows, features=features)
  undeclared = datasets.IterableDataset.from_generator(
      lambda: ({"translation": t, "n": 1} for t in rows["translation"]))
  assert undeclared.features is None
  for dataset in (declared, declared.to_iterable_dataset(), undeclared):
    hf_datasets.check_column(dataset, "translation.de", "target_column", "here")
    assert list(hf_datasets.texts(dataset, ["translation.en", "translation.de"], "here")
                ) == list(zip(EN[:4], DE[:4]))
    with pytest.raises(ConfigError, match=r"'n' is not a text column of here"):
      hf_datasets.check_column(dataset, "n", "source_column", "here")
    with pytest.raises(ConfigError, match=r"its columns: translation.de, translation.en, n"):
      hf_datasets.check_column(dataset, "translation", "source_column", "here")
