"""The paper's optimizer: Adam(β1=0.9, β2=0.98, ε=1e-9) with warmup then inverse-sqrt decay
(train.schedule "rsqrt"), or a constant rate after a linear warmup ("constant": the
algorithmic tasks' protocol, Delétang et al. 2023, trains at a constant Adam rate)."""

import jax
import jax.numpy as jnp
import optax


def rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lr(step) = scale · d_model^-0.5 · min(n^-0.5, n · warmup^-1.5) with n = step + 1
  (eq. 3 of the paper; n counts updates from 1 so the first update is not lr 0)."""

  def schedule(step):
    n = jnp.asarray(step, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(n ** -0.5, n * warmup_steps ** -1.5)

  return schedule


def constant_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lr(step) = scale · min(1, n / warmup) with n = step + 1: `scale` is the rate itself."""
  del d_model

  def schedule(step):
    n = jnp.asarray(step, jnp.float32) + 1.0
    return scale * jnp.minimum(1.0, n / warmup_steps)

  return schedule


SCHEDULES = {"rsqrt": rsqrt_schedule, "constant": constant_schedule}  # train.schedule


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0) -> optax.GradientTransformation:
  """AdamW with the paper's moments; decay applies to matrices only, not to biases, norm
  scales or per-head scalars; optional global-norm gradient clipping (0 = off)."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
  adamw = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=weight_decay,
                      mask=decay_mask)
  if grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm), adamw)
  return adamw
