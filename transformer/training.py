"""Training: one jitted train step over a device mesh, orbax checkpoints, exact resume."""

import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from transformer import checkpoint, experiment, sharding, workdir as workdir_lib
from transformer.data import sources
from transformer.evaluation import Evaluator
from transformer.metrics import loss_head_metrics
from transformer.registry import ConfigError

log = logging.getLogger("transformer")


def make_train_step(graphdef, optimizer, schedule, *, label_smoothing: float, seed: int,
                    accumulation_steps: int = 1, loss_chunks: int = 1):
  """(state, batch) -> (state, metric sums); dropout keys are folded from (seed, step), so
  a resumed run draws the same masks as an uninterrupted one.

  With accumulation_steps = k the batch is split into k micro-batches (rows i, i+k, ...)
  whose gradients of the summed loss are added up before dividing by the batch's token
  count: the update of the whole batch, in 1/k of the activation memory.

  The loss head (metrics.loss_head_metrics) makes the logits of 1/loss_chunks of the
  target tokens at a time and their gradients in the same pass, so the [tokens, vocab]
  logits never exist whole.
  """

  def summed_loss(params, batch, key):
    model = nnx.merge(graphdef, params)
    y = model.features(batch, rngs=nnx.Rngs(dropout=key))
    w_out, bias = model.embeddings.projection(y.dtype)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    sums = loss_head_metrics(flat(y), w_out, bias, flat(batch["targets"]),
                             flat(batch["targets_segmentation"] > 0).astype(jnp.float32),
                             label_smoothing, loss_chunks)
    return sums["loss"], sums

  grad_fn = jax.grad(summed_loss, has_aux=True)

  def gradients(params, batch, key):
    if accumulation_steps == 1:
      return grad_fn(params, batch, key)
    k = accumulation_steps
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                         batch)

    def add_micro_batch(total, xs):
      part = grad_fn(params, xs[0], jax.random.fold_in(key, xs[1]))
      return jax.tree.map(jnp.add, total, part), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, batch, key))
    return jax.lax.scan(add_micro_batch, zeros, (micro, jnp.arange(k)))[0]

  def train_step(state, batch):
    key = jax.random.fold_in(jax.random.key(seed), state["step"])
    grads, sums = gradients(state["params"], batch, key)
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    sums["learning_rate"] = schedule(state["step"])
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}
    return new_state, sums

  return train_step


def _format_duration(seconds: float) -> str:
  m, s = divmod(int(seconds), 60)
  return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def log_train(workdir: str, step: int, num_steps: int, sums: list[dict], elapsed: float,
              steps: int, eta_seconds: float) -> None:
  """Logs and records the metrics summed over the last `steps` train steps."""
  totals = jax.tree.map(lambda *x: float(np.sum(x)), *jax.device_get(sums))
  record = {"step": step, "split": "train",
            "loss": totals["loss"] / totals["tokens"],
            "accuracy": totals["correct"] / totals["tokens"],
            "learning_rate": float(sums[-1]["learning_rate"]),
            "tokens_per_sec": totals["tokens"] / elapsed,
            "ms_per_step": 1e3 * elapsed / steps}
  log.info("step %d/%d | loss %.4f | acc %.4f | lr %.2e | %s tgt tok/s | %.1f ms/step | ETA %s",
           step, num_steps, record["loss"], record["accuracy"], record["learning_rate"],
           f"{record['tokens_per_sec']:,.0f}", record["ms_per_step"],
           _format_duration(eta_seconds))
  workdir_lib.append_metrics(workdir, record)


def log_eval(workdir: str, step: int, results: dict[str, dict]) -> None:
  for split, m in results.items():
    shown = " | ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float))
    log.info("eval %s step %d | %s (%d examples)", split, step, shown, m["examples"])
    workdir_lib.append_metrics(workdir, {"step": step, "split": split, **m})


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       should_stop: Callable[[], bool] = lambda: False) -> int:
  """Trains to config.train.num_steps, resuming from the latest checkpoint in `workdir`.

  `should_stop` is polled after every step; when it returns True the state is saved and
  training returns early. Returns the step reached.
  """
  train_cfg = config.train
  source = sources.make_source(config, workdir)
  optimizer = experiment.make_optimizer(config)
  schedule = experiment.make_schedule(config)
  graphdef, init = experiment.make_init(config, source.vocab_size, optimizer)  # validates it
  mesh = sharding.make_mesh(config.mesh.to_dict())
  sharding.check_batch_size(train_cfg.batch_size, mesh, train_cfg.accumulation_steps)
  if train_cfg.loss_chunks < 1:
    raise ConfigError(f"train.loss_chunks must be at least 1, got {train_cfg.loss_chunks}")
  workdir_lib.prepare(config, workdir)  # nothing is written before the config is known good
  source.prepare()  # e.g. trains the tokenizer into the workdir on the first run

  state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  mngr = checkpoint.manager(workdir, max_to_keep=train_cfg.keep_checkpoints)
  batches = iter(source.train_batches())
  if mngr.latest_step() is not None:
    step, state = checkpoint.restore(mngr, jax.eval_shape(init), state_sharding,
                                     data_iterator=batches)
    log.info("resuming from the checkpoint at step %d in %s", step, mngr.directory)
  else:
    state = jax.jit(init, out_shardings=state_sharding)()
  step = int(state["step"])
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  log.info("model: %s parameters; %d device(s)", f"{n_params:,}", mesh.size)

  train_step = jax.jit(
      make_train_step(graphdef, optimizer, schedule, label_smoothing=train_cfg.label_smoothing,
                      seed=config.seed, accumulation_steps=train_cfg.accumulation_steps,
                      loss_chunks=train_cfg.loss_chunks),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
      donate_argnums=0)
  evaluator = Evaluator(graphdef, config.eval.batch_size)
  splits = source.eval_splits(config.train.eval_examples)

  sums, interval_start, interval_steps, timed_steps, timed_seconds = [], time.time(), 0, 0, 0.0
  while step < train_cfg.num_steps:
    batch = jax.make_array_from_process_local_data(batch_sharding, next(batches))
    state, metrics = train_step(state, batch)
    sums.append(metrics)
    step += 1
    interval_steps += 1
    if step % train_cfg.log_every == 0 or step == train_cfg.num_steps:
      jax.block_until_ready(metrics)  # steps are dispatched ahead: time them to completion
      elapsed = time.time() - interval_start
      if step > train_cfg.log_every:  # the first interval includes compilation
        timed_steps, timed_seconds = timed_steps + interval_steps, timed_seconds + elapsed
      sec_per_step = timed_seconds / timed_steps if timed_steps else elapsed / interval_steps
      log_train(workdir, step, train_cfg.num_steps, sums, elapsed, interval_steps,
                eta_seconds=sec_per_step * (train_cfg.num_steps - step))
      sums, interval_start, interval_steps = [], time.time(), 0
    if step == train_cfg.num_steps or (train_cfg.eval_every and step % train_cfg.eval_every == 0):
      eval_start = time.time()
      log_eval(workdir, step, evaluator.evaluate(state["params"], splits, source)[0])
      interval_start += time.time() - eval_start  # evaluation time is not training throughput
    stopping = should_stop()
    if step % train_cfg.checkpoint_every == 0 or step == train_cfg.num_steps or stopping:
      checkpoint.save(mngr, step, state, batches)
    if stopping:
      log.info("stopped at step %d; checkpoint saved; re-run the same command to resume", step)
      break
  mngr.wait_until_finished()
  mngr.close()
  return step
