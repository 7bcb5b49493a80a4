"""The stand-in's worker process: run one task (a function's source, its arguments), write
(ok, result or traceback) to the result file."""
import pickle
import sys
import traceback

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        src, name, args, kwargs = pickle.load(f)
    try:
        scope = {"__name__": "__ray_standin_task__"}
        exec(compile(src, f"<remote function {name}>", "exec"), scope)
        out = (True, scope[name](*args, **kwargs))
    except BaseException:
        out = (False, traceback.format_exc())
    with open(sys.argv[2], "wb") as f:
        pickle.dump(out, f)
