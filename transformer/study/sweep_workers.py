"""Which share of a sweep's runs this process trains: worker I of N takes every N-th run
(study/sweep.run). I and N come from --worker / --num_workers, or in a SLURM job array
(`sbatch --array=0-N-1 ...`, or any MIN-MAX:STEP range) from its environment: worker
(SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP of
SLURM_ARRAY_TASK_COUNT. Every value is checked like a config field: a bad one is one
ConfigError naming it and what is allowed, before anything runs."""

from collections.abc import Mapping

from transformer.core.errors import ConfigError

TASK_ID, COUNT = "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"
MIN, STEP = "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP"


def assignment(worker: int | None, num_workers: int | None, env: Mapping[str, str]
               ) -> tuple[int, int]:
  """(worker, num_workers): the flags' values where either is given (None: not given; the
  other then defaults to 0 or 1), else a SLURM job array's (module docstring), else (0, 1)."""
  if worker is None and num_workers is None and TASK_ID in env:
    return _from_slurm(env)
  worker, num_workers = (0 if worker is None else worker), (1 if num_workers is None
                                                            else num_workers)
  if num_workers < 1:
    raise ConfigError(f"--num_workers={num_workers} is not allowed; it must be ≥ 1 (the "
                      "number of workers that share the sweep's runs)")
  if not 0 <= worker < num_workers:
    raise ConfigError(f"--worker={worker} is not allowed; it must be in 0..{num_workers - 1} "
                      f"(--num_workers={num_workers})")
  return worker, num_workers


def _integer(env: Mapping[str, str], name: str, default: int | None = None, least: int = 0
             ) -> int:
  text = env.get(name)
  if text is None and default is not None:
    return default
  if text is None:
    raise ConfigError(f"{TASK_ID}={env[TASK_ID]} is set but {name} is not: a SLURM job array "
                      "sets both; outside one, unset it or give --worker I and --num_workers N")
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < least:
    raise ConfigError(f"{name}={text!r} is not allowed; it must be an integer ≥ {least} (as a "
                      "SLURM job array sets it), or give --worker I and --num_workers N")
  return value


def _from_slurm(env: Mapping[str, str]) -> tuple[int, int]:
  task, count = _integer(env, TASK_ID), _integer(env, COUNT, least=1)
  first, step = _integer(env, MIN, default=0), _integer(env, STEP, default=1, least=1)
  worker, off = divmod(task - first, step)
  if off or not 0 <= worker < count:
    raise ConfigError(
        f"{TASK_ID}={task} is not one of the {count} task(s) of the job array "
        f"{first}, {first + step}, ... ({MIN}={first}, {STEP}={step}, {COUNT}={count}); "
        "submit the array as --array=0-N-1 (or MIN-MAX:STEP), or give --worker I and "
        "--num_workers N")
  return worker, count
