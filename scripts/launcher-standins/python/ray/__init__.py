"""Stand-in for the `ray` package, for scripts/test-launchers.sh where Ray is not installed
(put scripts/launcher-standins/python on PYTHONPATH). It keeps the one thing about Ray that
decides whether expseg reaches its workers: the ENVIRONMENT a worker process starts with.

- In Ray a task runs in a worker process that the node's raylet starts. The raylet has the
  environment of whoever started the node: `ray start` (on a cluster), or the driver that
  called ray.init() without an address (a local node, the driver's child). Here
  ray.init(address="auto") takes the environment that the `ray start` stand-in (bin/ray)
  recorded, and ray.init() the driver's own.
- With a runtime_env, the raylet starts the worker through setup_worker.py, which applies
  runtime_env["env_vars"] with os.environ.update() and then execs the worker command
  (ray/_private/runtime_env/context.py, RuntimeEnvContext.exec_worker). LD_PRELOAD given
  there is in the environment of that exec, so the dynamic loader loads it. Here:
  python -m ray._setup_worker does the same, then execs python -m ray._worker.
- `ray job submit --runtime-env-json J -- CMD` (bin/ray) runs CMD, the job's driver, with the
  node's environment plus J's env_vars, as Ray's job supervisor runs the entrypoint, and J is the
  job's runtime_env: ray.init() in CMD applies it to every worker.
- Per-task and per-actor runtime_env (@ray.remote(runtime_env=...)) merge over the job's.

Not here: scheduling, object store, actors, resources, a dashboard. A remote function is sent
to its worker as source text (inspect.getsource), so it must import what it uses.
"""

import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap

__version__ = "0.0.0-standin"
_state = {"env": None, "runtime_env": {}}


def _note(msg):
    sys.stderr.write(f"[ray stand-in] {msg}\n")


def state_dir():
    return os.environ.get("RAY_STANDIN_DIR") or os.path.join(tempfile.gettempdir(), f"ray-standin-{os.getuid()}")


def init(address=None, runtime_env=None, **_ignored):
    if address in ("auto", "local") or (address is None and os.environ.get("RAY_ADDRESS")):
        try:
            with open(os.path.join(state_dir(), "node.json")) as f:
                _state["env"] = json.load(f)["env"]
        except OSError:
            raise ConnectionError(f"no node started with `ray start` (stand-in state in {state_dir()})")
        _note("connected to the node of `ray start`: workers get its environment")
    else:
        _state["env"] = dict(os.environ)
        _note("started a local node: workers get the driver's environment")
    # A job's entrypoint (`ray job submit --runtime-env-json`): the job's runtime_env is the
    # default of ray.init(), as Ray's job config makes it.
    job = json.loads(os.environ.get("RAY_STANDIN_JOB_RUNTIME_ENV") or "{}")
    _state["runtime_env"] = dict(runtime_env or job)


def is_initialized():
    return _state["env"] is not None


def shutdown():
    _state["env"] = None


class ObjectRef:
    def __init__(self, proc, result):
        self._proc, self._result = proc, result


def _run(fn_source, fn_name, args, kwargs, runtime_env):
    if _state["env"] is None:
        init()
    merged = dict(_state["runtime_env"])
    merged.update(runtime_env or {})
    env_vars = {k: str(v) for k, v in dict(_state["runtime_env"].get("env_vars", {}), **(runtime_env or {}).get("env_vars", {})).items()}
    merged["env_vars"] = env_vars
    fd, task = tempfile.mkstemp(prefix="ray-standin-task-")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((fn_source, fn_name, args, kwargs), f)
    result = task + ".out"
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(_state["env"])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    worker = [sys.executable, "-m", "ray._worker", task, result]
    if env_vars:
        cmd = [sys.executable, "-m", "ray._setup_worker", "--serialized-runtime-env-context",
               json.dumps({"env_vars": env_vars})] + worker
    else:
        cmd = worker
    return ObjectRef(subprocess.Popen(cmd, env=env), result)


class RemoteFunction:
    def __init__(self, fn, options):
        src = textwrap.dedent(inspect.getsource(fn))
        lines = src.splitlines()
        while lines and lines[0].lstrip().startswith("@"):
            lines.pop(0)
        self._src, self._name, self._options = "\n".join(lines) + "\n", fn.__name__, options

    def remote(self, *args, **kwargs):
        return _run(self._src, self._name, args, kwargs, self._options.get("runtime_env"))

    def options(self, **options):
        r = RemoteFunction.__new__(RemoteFunction)
        r._src, r._name, r._options = self._src, self._name, dict(self._options, **options)
        return r


def remote(*args, **options):
    if len(args) == 1 and callable(args[0]) and not options:
        return RemoteFunction(args[0], {})
    return lambda fn: RemoteFunction(fn, options)


def get(refs, timeout=None):
    if isinstance(refs, (list, tuple)):
        return [get(r, timeout) for r in refs]
    rc = refs._proc.wait(timeout)
    try:
        with open(refs._result, "rb") as f:
            ok, value = pickle.load(f)
    except OSError:
        raise RuntimeError(f"ray stand-in: the worker died (exit status {rc})")
    finally:
        for p in (refs._result, refs._result[: -len(".out")]):
            try:
                os.unlink(p)
            except OSError:
                pass
    if not ok:
        raise RuntimeError(f"ray stand-in: the task failed:\n{value}")
    return value
