"""Training data at scale: first-run preparation, re-run start, memory, speed and stalls.

  python benchmarks/data_scale.py --sizes 29000,1000000,4500000 [--work /tmp/data_scale]

For each N builds a corpus of N pairs from the Multi30k training files (line k of copy c gets
the marker " #c" on both sides, so lines differ), then in separate processes:
  prepare  the first run: trains the tokenizer (on its bounded sample) and encodes the corpus;
  rerun    a re-run on the same cache: time from process start (and from after imports) to
           the first training batch, batches/s and target fill over --batches batches, the
           longest gap between two batches (also across an epoch boundary: the iterator is
           moved to the last windows of epoch 0 and run into epoch 1), and the peak RSS.
Prints one JSON line per process and a table. Deletes the corpora unless --keep.
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

START = time.perf_counter()
MULTI30K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "multi30k")


def make_corpus(directory: str, n: int, multi30k: str) -> None:
  os.makedirs(directory, exist_ok=True)
  for lang in ("en", "de"):
    with gzip.open(os.path.join(multi30k, f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
      lines = f.read().splitlines()
    with open(os.path.join(directory, f"train.{lang}"), "w", encoding="utf-8") as out:
      written, copy = 0, 0
      while written < n:
        part = lines[:n - written]
        suffix = f" #{copy}\n" if copy else "\n"
        out.write(suffix.join(part) + suffix)
        written, copy = written + len(part), copy + 1


def config_for(directory: str, multi30k: str, batch_size: int):
  from configs import multi30k as recipe  # noqa: PLC0415

  config = recipe.get_config()
  config.data.update(dir=directory, train_source="train.en", train_target="train.de",
                     valid_source=os.path.join(multi30k, "val.en.gz"),
                     valid_target=os.path.join(multi30k, "val.de.gz"))
  config.train.batch_size = batch_size
  return config


def peak_rss_mb() -> float:
  import resource  # noqa: PLC0415

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> dict:
  from transformer.run import experiment  # noqa: PLC0415
  from transformer.run.config import parse  # noqa: PLC0415

  imported = time.perf_counter()

  config = config_for(args.corpus, args.multi30k, args.batch_size)
  source = experiment.make_source(parse(config), args.corpus)
  source.load()  # the tokenizer (trained in memory on the first run)
  if args.child == "prepare":
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
  for _ in range(args.batches):
    batch = next(iterator)
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
    real += int((batch["targets_segmentation"] > 0).sum())
    slots += batch["targets"].size
  result.update(batches_per_s=len(gaps) / sum(gaps), fill=real / slots, max_gap_s=max(gaps))
  iterator.set_state({"epoch": 0, "window": max(0, dataset.num_windows - 2), "row": 0})
  boundary_gaps, last = [], time.perf_counter()
  while iterator.get_state()["epoch"] == 0 or iterator.get_state()["window"] < 1:
    next(iterator)
    now = time.perf_counter()
    boundary_gaps.append(now - last)
    last = now
  result.update(epoch_boundary_batches=len(boundary_gaps),
                epoch_boundary_max_gap_s=max(boundary_gaps),
                windows_per_epoch=dataset.num_windows, peak_rss_mb=peak_rss_mb())
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="29000,1000000")
  parser.add_argument("--work", default="/tmp/data_scale")
  parser.add_argument("--multi30k", default=MULTI30K)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--batches", type=int, default=2000)
  parser.add_argument("--keep", action="store_true")
  parser.add_argument("--child", choices=["prepare", "rerun"])
  parser.add_argument("--corpus")
  args = parser.parse_args()
  if args.child:
    print(json.dumps({"child": args.child, **child(args)}), flush=True)
    return
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  rows = []
  for n in [int(s) for s in args.sizes.split(",")]:
    corpus = os.path.join(args.work, f"n{n}")
    shutil.rmtree(corpus, ignore_errors=True)
    start = time.perf_counter()
    make_corpus(corpus, n, args.multi30k)
    print(f"N={n}: corpus written in {time.perf_counter() - start:.1f} s", flush=True)
    row = {"n": n}
    for mode in ("prepare", "rerun"):
      out = subprocess.run([sys.executable, __file__, "--child", mode, "--corpus", corpus,
                            "--multi30k", args.multi30k, "--batch_size", str(args.batch_size),
                            "--batches", str(args.batches)], env=env, check=True,
                           capture_output=True, text=True)
      result = json.loads(out.stdout.strip().splitlines()[-1])
      print(json.dumps({"n": n, **result}), flush=True)
      row.update({f"{mode}_{k}": v for k, v in result.items() if k != "child"})
    rows.append(row)
    if not args.keep:
      shutil.rmtree(corpus, ignore_errors=True)
  print(f"\n{'N':>9} {'prepare s':>9} {'enc sent/s':>10} {'1st batch s':>11} {'rss MB':>7} "
        f"{'batch/s':>8} {'fill':>6} {'max gap s':>9} {'epoch gap s':>11}")
  for r in rows:
    print(f"{r['n']:>9,} {r['prepare_prepare_s']:>9.1f} "
          f"{r['prepare_encode_sentences_per_s']:>10,.0f} {r['rerun_first_batch_s']:>11.1f} "
          f"{r['rerun_peak_rss_mb']:>7.0f} {r['rerun_batches_per_s']:>8.0f} "
          f"{r['rerun_fill']:>6.1%} {r['rerun_max_gap_s']:>9.3f} "
          f"{r['rerun_epoch_boundary_max_gap_s']:>11.3f}")


if __name__ == "__main__":
  main()
