"""Starting the processes (hosts) of one job: jax.distributed.initialize, checked before it
starts and bounded while it waits.

JAX's coordination service binds its port with SO_REUSEPORT (gRPC's default): a process 0
started where an earlier launch still holds the port starts a second service without an
error, the kernel hands the other processes' connections to the earlier one, and process 0
waits until JAX aborts it (300 s, exit 134, a C++ stack trace). So process 0 refuses a port
that another process listens on, and every process that has not joined within
`join_timeout` seconds says so in one line and exits: JAX's own timeout aborts the process
from C++ (nothing Python can catch), so a watchdog thread exits first.
"""

import contextlib
import errno
import logging
import os
import socket
import threading

import jax

from transformer.core.errors import ConfigError, one_line

HEARTBEAT_S = 30  # a process silent this long counts as dead (JAX's default: 100)
JOIN_TIMEOUT_S = 120  # --join_timeout's default (JAX's initialization_timeout: 300)
EXIT_STATUS = 1  # a job that cannot start: the run cannot go on (as a RunError)


def check(address: str | None, num_processes: int | None, process_id: int | None,
          join_timeout: int) -> None:
  """A ConfigError, before anything starts, for distributed flags that cannot make a job:
  --coordinator_address without the other two, a HOST:PORT that is not one, fewer than one
  process, a process id outside 0..num_processes-1, a join timeout below 1 s."""
  if join_timeout < 1:
    raise ConfigError(f"--join_timeout={join_timeout} is not allowed; it must be ≥ 1 (seconds)")
  if address is None:
    given = [f"--{n}" for n, v in (("num_processes", num_processes),
                                   ("process_id", process_id)) if v is not None]
    if given:
      raise ConfigError(f"{given[0]} starts a job by hand with --coordinator_address "
                        "HOST:PORT (process 0's), --num_processes and --process_id")
    return
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"--coordinator_address={address!r} is not allowed; it must be HOST:PORT "
                      "(process 0's host, a port in 1..65535), e.g. 127.0.0.1:8476")
  if num_processes is None or process_id is None:
    raise ConfigError("--coordinator_address needs --num_processes N and --process_id I "
                      "(0 for the process on the coordinator's host, 1..N-1 for the others)")
  if num_processes < 1:
    raise ConfigError(f"--num_processes={num_processes} is not allowed; it must be ≥ 1")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} is not allowed; it must be in 0.."
                      f"{num_processes - 1} (--num_processes={num_processes})")


def port_in_use(address: str) -> bool:
  """Whether another process listens on the port of `address` (HOST:PORT), where process 0
  is about to start the coordination service: binding as the service does ([::]:PORT, or
  JAX_COORDINATOR_BIND_ADDRESS) but without SO_REUSEPORT fails then. SO_REUSEADDR lets the
  probe bind over the closed connections of an earlier job (TIME_WAIT), never over a
  listener."""
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{address.rpartition(':')[2]}"
  host, _, port = bind.rpartition(":")
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    probe = socket.socket(family, socket.SOCK_STREAM)
  except OSError:  # no IPv6 here: the service binds IPv4 alone
    probe, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
  with probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if probe.family == socket.AF_INET6:
      probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
      probe.bind((host, int(port)))
    except OSError as e:
      return e.errno == errno.EADDRINUSE
  return False


@contextlib.contextmanager
def deadline(seconds: float, message: str):
  """Exits the process with EXIT_STATUS and `message` as one `error:` line on stderr unless
  the block ends within `seconds`: for waits inside JAX's C++ (which releases the GIL
  there) that a Python exception cannot interrupt."""
  done = threading.Event()

  def expire():
    if not done.wait(seconds):
      os.write(2, f"error: {' '.join(message.split())}\n".encode())
      os._exit(EXIT_STATUS)  # the main thread is inside C++: nothing else would end it

  watchdog = threading.Thread(target=expire, name="join-deadline", daemon=True)
  watchdog.start()
  try:
    yield
  finally:
    done.set()


def initialize(address: str | None, num_processes: int | None, process_id: int | None,
               join_timeout: int = JOIN_TIMEOUT_S, from_environment: bool = False) -> None:
  """jax.distributed.initialize for a job started by hand (`address` HOST:PORT of process
  0, `num_processes`, `process_id`) or, with `from_environment`, as the cluster says
  (SLURM, Open MPI, TPU pods); nothing for neither. Checked first (check; process 0: a port
  another process listens on is refused); then a process that has not joined the others
  within `join_timeout` seconds exits with one `error:` line (module docstring)."""
  check(address, num_processes, process_id, join_timeout)
  if address is None and not from_environment:
    return
  if address is not None and process_id == 0 and port_in_use(address):
    port = address.rpartition(":")[2]
    raise ConfigError(
        f"--coordinator_address={address}: another process already listens on port {port} "
        f"(a process of an earlier launch still running? `ss -ltnp | grep :{port}` names "
        "it); stop it, or give every process of this launch another port")
  if address is None:
    who, hint = "this process", "were all of the job's processes started?"
  else:
    who = f"process {process_id} of {num_processes}"
    hint = (f"were all {num_processes} processes started, with the same "
            "--coordinator_address and --num_processes, and is process 0 running there?")
  kwargs = {} if address is None else {"heartbeat_timeout_seconds": HEARTBEAT_S}
  # JAX logs its connecting at INFO on stderr, where a failure is to be one line
  logging.getLogger(jax.distributed.initialize.__module__).setLevel(logging.WARNING)
  with deadline(join_timeout, f"{who} could not join the job at "
                f"{address or 'the cluster coordinator'} within {join_timeout} s "
                f"(--join_timeout): {hint}"):
    # JAX's own timeout later: the watchdog speaks first
    try:
      jax.distributed.initialize(address, num_processes, process_id,
                                 initialization_timeout=join_timeout + 30, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:  # e.g. --distributed outside a cluster
      flag = "--distributed" if address is None else f"--coordinator_address={address}"
      raise ConfigError(f"{flag}: jax.distributed.initialize failed: {one_line(e)}"
                        + (" (no cluster environment found: SLURM, Open MPI, TPU pod; start "
                           "the processes by hand with --coordinator_address HOST:PORT "
                           "--num_processes N --process_id I)" if address is None else "")
                        ) from None
