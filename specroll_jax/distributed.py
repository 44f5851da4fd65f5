"""Several processes (hosts) in one run: a checked front door to ``jax.distributed.initialize``.

Call ``initialize(coordinator, num_processes, process_id)`` first in every process, before any
JAX computation; ``jax.devices()`` then lists every process's devices, and the GRPO steps take
``mesh=Mesh(np.array(jax.devices()), ("data",))``, so their gradient ``psum`` spans processes.
Each process feeds the step its own rows of the global batch
(``jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local_rows)``);
tests/test_multiprocess.py runs two processes on one machine this way.

Why a wrapper: jax's runtime does not raise when a process cannot reach the coordinator; after
``initialization_timeout`` its C++ client logs a fatal error and aborts the whole process
(SIGABRT, no Python exception, 5 minutes by default). Here a non-coordinator process first
waits up to ``timeout_s`` for the coordinator's port to accept a TCP connection and raises
``TimeoutError`` naming the address when it does not; process 0 checks that it can listen on the
port (``OSError`` naming it otherwise). jax's own ``initialization_timeout`` is then ``timeout_s``
too, for what a port probe cannot see (e.g. a process count that differs between processes).
"""

from __future__ import annotations

import socket
import time

import jax

from specroll_jax._fields import float_arg, int_arg

_BACKOFF_S = 0.2


def parse_address(coordinator) -> tuple[str, int]:
  """``"host:port"`` (IPv6 as ``"[::1]:port"``) -> (host, port); ValueError naming the field."""
  if not isinstance(coordinator, str):
    raise ValueError(f"coordinator must be a 'host:port' string, got {coordinator!r}")
  host, sep, port = coordinator.rpartition(":")
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  ok = sep and host and port.isdigit() and 1 <= int(port) <= 65535
  if not ok:
    raise ValueError(f"coordinator must be 'host:port' with a port in 1..65535, got "
                     f"{coordinator!r}")
  return host, int(port)


def check_args(coordinator, num_processes, process_id, timeout_s=60.0) -> tuple[str, int]:
  """ValueError naming the first bad argument; returns the coordinator's (host, port)."""
  host, port = parse_address(coordinator)
  n = int_arg(num_processes, "num_processes", 1)
  int_arg(process_id, f"process_id (num_processes={n})", 0, n - 1)
  float_arg(timeout_s, "timeout_s (seconds)", 1, allow_inf=True)
  return host, port


def wait_for_coordinator(host: str, port: int, timeout_s: float) -> None:
  """Return once ``host:port`` accepts a TCP connection; TimeoutError naming it after
  ``timeout_s``."""
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      break
    try:
      with socket.create_connection((host, port), timeout=min(left, 5.0)):
        return
    except OSError as e:  # refused (nothing listening yet), unreachable, unresolvable
      last = e
    time.sleep(min(_BACKOFF_S, max(deadline - time.monotonic(), 0)))
  raise TimeoutError(f"coordinator {host}:{port} did not accept a connection within {timeout_s} s "
                     f"(last error: {last}); is process 0 running, and is the address right?")


def _check_can_listen(port: int) -> None:
  """OSError naming the port when process 0's coordinator could not listen on it."""
  for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine: try IPv4
      continue
    with s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind((addr, port))
      except OSError as e:
        raise OSError(f"process 0 runs the coordinator but cannot listen on port {port}: {e} "
                      "(another run on this port?)") from None
    return


def _uses_cpu() -> bool:
  platforms = jax.config.jax_platforms
  return not platforms or "cpu" in platforms.split(",")


def initialize(coordinator: str, num_processes: int, process_id: int, *,
               timeout_s: float = 60.0) -> None:
  """Join a ``num_processes``-process JAX run whose coordinator is ``coordinator``
  (``"host:port"``, served by process 0) as process ``process_id``. Call it before any JAX
  computation. Uses gloo for CPU collectives (set when the CPU platform may be used). Raises
  ValueError for bad arguments, TimeoutError when the coordinator cannot be reached within
  ``timeout_s``, OSError when process 0 cannot listen on the port."""
  host, port = check_args(coordinator, num_processes, process_id, timeout_s)
  if _uses_cpu():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if process_id == 0:
    _check_can_listen(port)
  else:
    wait_for_coordinator(host, port, timeout_s)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=max(int(round(timeout_s)), 1))


# -- host values across processes (every process calls these at the same point; one process:
#    the value itself)


def _gather(x, tiled: bool = False):
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(x, tiled=tiled)


def all_sum(x):
  """The sum of every process's ``x`` (a numpy array or number; numpy out)."""
  import numpy as np
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(_gather(np.asarray(x))).sum(0)


def all_max(x: float) -> float:
  """The largest of every process's number ``x``."""
  import numpy as np
  if jax.process_count() == 1:
    return float(x)
  return float(np.asarray(_gather(np.float64(x))).max())


def all_rows(x):
  """Every process's rows of ``x`` concatenated in process order (axis 0; numpy out)."""
  import numpy as np
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(_gather(np.asarray(x), tiled=True))


def all_concat(x, axis: int):
  """Every process's ``x`` concatenated along ``axis`` (numpy out)."""
  import numpy as np
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.concatenate(list(np.asarray(_gather(np.asarray(x)))), axis=axis)


def from_process0(x):
  """Process 0's value of the array ``x`` in every process (e.g. a decision that depends on a
  timing each process measured for itself)."""
  import numpy as np
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(x)))
