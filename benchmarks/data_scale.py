"""Training data at scale: first-run preparation, re-run start, memory, speed and stalls.

  python benchmarks/data_scale.py --sizes 29000,1000000,4500000 --work /tmp/data_scale
  python benchmarks/data_scale.py --smoke         # seconds: does it still run

For each N builds a corpus of N pairs from the Multi30k training files (line k of copy c gets
the marker " #c" on both sides, so lines differ), then in separate processes:
  prepare  the first run: trains the tokenizer (on its bounded sample) and encodes the corpus;
  rerun    a re-run on the same cache: time from process start (and from after imports) to
           the first training batch, batches/s and target fill over --batches batches, the
           longest gap between two batches (also across an epoch boundary: the iterator is
           moved to the last windows of epoch 0 and run into epoch 1), and the peak RSS.
The held-out splits are Multi30k's own (configs/multi30k.py's file names under --multi30k,
by default that config's data.dir; where to get them: docs/data.md). Prints one JSON line
per process and a table. Deletes the corpora unless --keep.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time

START = time.perf_counter()

from absl import flags  # noqa: E402 - START times the imports too

import harness  # noqa: E402
from transformer.core.errors import ConfigError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_list("sizes", ["29000", "1000000"], "Corpus sizes N (pairs).")
flags.DEFINE_string("work", "/tmp/data_scale", "Where the corpora and their caches go.")
flags.DEFINE_string("multi30k", None, "Multi30k's directory (default: configs/multi30k.py's "
                    "data.dir).")
flags.DEFINE_integer("batch_size", 128, "Rows per batch.")
flags.DEFINE_integer("vocab_size", 0, "Sentencepiece pieces (0: configs/multi30k.py's).")
flags.DEFINE_integer("batches", 2000, "Batches timed in the re-run.")
flags.DEFINE_bool("keep", False, "Keep the corpora and their caches.")
flags.DEFINE_enum("child", None, ["prepare", "rerun"], "(internal) one process's part.")
flags.DEFINE_string("corpus", None, "(internal) the corpus directory of --child.")
harness.define_smoke(sizes=["300"], batch_size=8, vocab_size=256, batches=20)


def recipe():
  """configs/multi30k.py's config, of this checkout."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from configs import multi30k  # noqa: PLC0415

  return multi30k.get_config()


def make_corpus(directory: str, n: int, multi30k: str) -> None:
  os.makedirs(directory, exist_ok=True)
  files = multi30k_files(multi30k)
  for side, lang in (("source", "en"), ("target", "de")):
    with gzip.open(files[f"train_{side}"], "rt", encoding="utf-8") as f:
      lines = f.read().splitlines()
    with open(os.path.join(directory, f"train.{lang}"), "w", encoding="utf-8") as out:
      written, copy = 0, 0
      while written < n:
        part = lines[:n - written]
        suffix = f" #{copy}\n" if copy else "\n"
        out.write(suffix.join(part) + suffix)
        written, copy = written + len(part), copy + 1


def multi30k_files(multi30k: str) -> dict[str, str]:
  """{config.data field: path} of the Multi30k files configs/multi30k.py reads, under
  `multi30k`; a ConfigError naming what is missing and where to get it."""
  data = recipe().data
  files = {f"{split}_{side}": os.path.abspath(os.path.join(multi30k, data[f"{split}_{side}"]))
           for split in ("train", "valid", "test") for side in ("source", "target")
           if data.get(f"{split}_{side}")}
  missing = [path for path in files.values() if not os.path.isfile(path)]
  if missing:
    more = f" (and {len(missing) - 1} more of its files)" if len(missing) > 1 else ""
    raise ConfigError(f"Multi30k not found: {missing[0]}{more}; --multi30k DIR names a "
                      "directory with configs/multi30k.py's file names (docs/data.md: where "
                      "to get them)")
  return files


def config_for(directory: str, multi30k: str, batch_size: int, vocab_size: int):
  """configs/multi30k.py reading its training pairs from `directory` (train.en, train.de)
  and its held-out splits from Multi30k's own files."""
  config = recipe()
  held_out = {field: path for field, path in multi30k_files(multi30k).items()
              if not field.startswith("train_")}
  config.data.update(dir=directory, train_source="train.en", train_target="train.de",
                     **held_out)
  config.data.vocab_size = vocab_size or config.data.vocab_size
  config.train.batch_size = batch_size
  return config


def peak_rss_mb() -> float:
  import resource  # noqa: PLC0415

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child() -> dict:
  from transformer.model.embeddings import target_weights  # noqa: PLC0415
  from transformer.run import experiment  # noqa: PLC0415
  from transformer.run.config import parse  # noqa: PLC0415

  imported = time.perf_counter()
  f = flags.FLAGS
  config = config_for(f.corpus, f.multi30k, f.batch_size, f.vocab_size)
  source = experiment.make_source(parse(config), f.corpus)
  source.load()  # the tokenizer (trained in memory on the first run)
  if f.child == "prepare":
    start = time.perf_counter()
    source.prepare()  # writes it and encodes the corpus
    corpus = source.encoded_corpus()
    seconds = time.perf_counter() - start
    return {"prepare_s": time.perf_counter() - START, "encode_s": seconds,
            "encode_sentences_per_s": 2 * len(corpus) / seconds, "records": len(corpus),
            "peak_rss_mb": peak_rss_mb()}
  dataset = source.train_batches()
  iterator = iter(dataset)
  batch = next(iterator)
  first = time.perf_counter()
  result = {"first_batch_s": first - START, "first_batch_after_imports_s": first - imported}
  gaps, real, slots, last = [], 0, 0, time.perf_counter()
  for _ in range(f.batches):
    batch = next(iterator)
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
    real += int(target_weights(batch).sum())
    slots += batch["targets"].size
  result.update(batches_per_s=len(gaps) / sum(gaps), fill=real / slots, max_gap_s=max(gaps))
  iterator.set_state({"epoch": 0, "window": max(0, dataset.num_windows - 2), "row": 0})
  boundary_gaps, last = [], time.perf_counter()
  # Into epoch 1's second window (with a single window per epoch: through epoch 1).
  while (state := iterator.get_state())["epoch"] == 0 or (
      state["epoch"] == 1 and state["window"] < 1):
    next(iterator)
    now = time.perf_counter()
    boundary_gaps.append(now - last)
    last = now
  result.update(epoch_boundary_batches=len(boundary_gaps),
                epoch_boundary_max_gap_s=max(boundary_gaps),
                windows_per_epoch=dataset.num_windows, peak_rss_mb=peak_rss_mb())
  return result


def report() -> None:
  f = flags.FLAGS
  if f.multi30k is None:
    f.multi30k = recipe().data.dir
  if f.child:
    print(json.dumps({"child": f.child, **child()}), flush=True)
    return
  multi30k_files(f.multi30k)  # a missing corpus fails here, before anything is written
  rows = [measure(int(n)) for n in f.sizes]
  print(f"\n{'N':>9} {'prepare s':>9} {'enc sent/s':>10} {'1st batch s':>11} {'rss MB':>7} "
        f"{'batch/s':>8} {'fill':>6} {'max gap s':>9} {'epoch gap s':>11}")
  for r in rows:
    print(f"{r['n']:>9,} {r['prepare_prepare_s']:>9.1f} "
          f"{r['prepare_encode_sentences_per_s']:>10,.0f} {r['rerun_first_batch_s']:>11.1f} "
          f"{r['rerun_peak_rss_mb']:>7.0f} {r['rerun_batches_per_s']:>8.0f} "
          f"{r['rerun_fill']:>6.1%} {r['rerun_max_gap_s']:>9.3f} "
          f"{r['rerun_epoch_boundary_max_gap_s']:>11.3f}")


def measure(n: int) -> dict:
  """The row of N pairs: a corpus made, then a `prepare` and a `rerun` process on it."""
  f = flags.FLAGS
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  corpus = os.path.join(f.work, f"n{n}")
  shutil.rmtree(corpus, ignore_errors=True)
  start = time.perf_counter()
  make_corpus(corpus, n, f.multi30k)
  print(f"N={n}: corpus written in {time.perf_counter() - start:.1f} s", flush=True)
  row = {"n": n}
  for mode in ("prepare", "rerun"):
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--corpus", corpus,
                          "--multi30k", f.multi30k, "--batch_size", str(f.batch_size),
                          "--vocab_size", str(f.vocab_size), "--batches", str(f.batches)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
      raise RuntimeError(f"the {mode} process of N={n} failed:\n{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({"n": n, **result}), flush=True)
    row.update({f"{mode}_{k}": v for k, v in result.items() if k != "child"})
  if not f.keep:
    shutil.rmtree(corpus, ignore_errors=True)
  return row


if __name__ == "__main__":
  harness.run(report)
