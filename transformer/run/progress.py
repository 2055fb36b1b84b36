"""What a run says as it goes: a line and a record per logging interval of training, a line
per held-out split evaluated, the first call of a jitted function timed (the compilation
that the first log line waits for), and durations as a person reads them."""

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from transformer.run import compile_cache

log = logging.getLogger("transformer")


def duration(seconds: float) -> str:
  """A duration as a person reads it: `4m07s`, or `2h05m` from an hour on (seconds dropped)."""
  m, s = divmod(int(seconds), 60)
  return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def log_train(step: int, num_steps: int, sums: list[dict], elapsed: float, steps: int,
              eta_seconds: float) -> dict:
  """Logs the metrics summed over the last `steps` train steps; returns their record."""
  totals = jax.tree.map(lambda *x: float(np.sum(x)), *jax.device_get(sums))
  applied = max(steps - totals["nonfinite"], 1)
  record = {"step": step, "split": "train",
            "loss": totals["loss"] / max(totals["tokens"], 1.0),
            "accuracy": totals["correct"] / max(totals["tokens"], 1.0),
            "learning_rate": float(sums[-1]["learning_rate"]),
            "grad_norm": totals["grad_norm"] / applied,
            "skipped_steps": int(totals["nonfinite"]),
            "tokens_per_sec": totals["tokens"] / elapsed,
            "ms_per_step": 1e3 * elapsed / steps}
  if "z_loss" in totals:  # train.z_loss > 0: its term's mean per token (included in loss)
    record["z_loss"] = totals["z_loss"] / max(totals["tokens"], 1.0)
  log.info("step %d/%d | loss %.4f | acc %.4f | lr %.2e | grad norm %.3f | %s tgt tok/s | "
           "%.1f ms/step | ETA %s%s%s", step, num_steps, record["loss"], record["accuracy"],
           record["learning_rate"], record["grad_norm"], f"{record['tokens_per_sec']:,.0f}",
           record["ms_per_step"], duration(eta_seconds),
           f" | z-loss {record['z_loss']:.4f}" if "z_loss" in record else "",
           f" | {record['skipped_steps']} non-finite steps skipped" if record["skipped_steps"]
           else "")
  return record


def log_eval(step: int, results: dict[str, dict]) -> None:
  """Logs the held-out metrics (numbers: floats to 4 decimals, counts as integers)."""
  for split, m in results.items():
    shown = " | ".join(f"{k} {_number(v)}" for k, v in m.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)
                       and k != "examples")
    log.info("eval %s step %d | %s (%d examples)", split, step, shown, m["examples"])


def log_eval_start(step: int, splits: dict) -> None:
  """Logs that an evaluation begins (its first batches wait for compilation)."""
  log.info("evaluating step %d: %s", step,
           ", ".join(f"{name} ({len(split)} examples)" for name, split in splits.items()))


def _number(value: int | float) -> str:
  return f"{value:d}" if isinstance(value, int) else f"{value:.4f}"


def timing_first_call(fn: Callable, what: str) -> Callable:
  """`fn` (a jitted function), logging around its first call, which traces and compiles
  it: 'compiling WHAT...' before, 'compiled WHAT in N s' after (the call returns once the
  computation is compiled and dispatched), or 'loaded WHAT from the compilation cache in N
  s' when nothing was compiled (compile_cache), so the wait before the first log line is
  explained. Later calls are fn's."""
  first = True

  def call(*args):
    nonlocal first
    if not first:
      return fn(*args)
    first = False
    log.info("compiling %s...", what)
    start, before = time.time(), compile_cache.counts()
    out = fn(*args)
    after = compile_cache.counts()
    cached = after["loaded"] > before["loaded"] and after["compiled"] == before["compiled"]
    log.info("%s %s in %.1f s", "loaded" if cached else "compiled",
             f"{what} from the compilation cache" if cached else what, time.time() - start)
    return out

  return call
