"""The stand-in's setup_worker.py: apply the runtime_env's env_vars, then exec the worker, as
Ray's RuntimeEnvContext.exec_worker does (os.environ.update, then exec)."""
import json
import os
import sys

if __name__ == "__main__":
    assert sys.argv[1] == "--serialized-runtime-env-context"
    context = json.loads(sys.argv[2])
    os.environ.update(context.get("env_vars", {}))
    os.execvp(sys.argv[3], sys.argv[3:])
