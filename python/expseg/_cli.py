"""The commands a wheel puts on PATH, and ``python -m expseg``: each runs the tool installed
with the package (``_lib/``), with ``EXPSEG_LIB`` pointing at the installed library unless
the user set it."""

import os
import sys

from . import _LIB_DIR, __version__, library_path

USAGE = """usage: python -m expseg COMMAND [ARGS...]   (or: expseg COMMAND ...)

  --lib                 print the installed libexpseg.so's path:
                          LD_PRELOAD=$(python -m expseg --lib) python train.py
  run CMD...            run CMD under expseg (the same as expseg-run CMD...)
  srun [SRUN ARGS] CMD  srun with every task under expseg (expseg-srun)
  doctor                check whether expseg can work on this machine
  pause PID... [--discard] [--tag NAME]
                        pause the GPU memory of running expseg processes of yours (bytes to
                        host memory, GPU memory back to the driver); --all, --tree PID,
                        --gpu N
  resume PID...         bring it back at the same addresses
  paused PID...         bytes paused now
  report-merge DIR|F... one table of many ranks' JSON reports (expseg-report-merge)
  glibc FILE            the highest GLIBC_ version FILE requires
  --version             the package's version
  --help                this text

In Python: import expseg; expseg.active(), expseg.stats(), expseg.library_path(),
expseg.pause(), expseg.resume(), expseg.paused(), with expseg.tag(NAME): ..."""


def _tool(name):
    path = os.path.join(_LIB_DIR, name)
    if not os.path.isfile(path):
        sys.stderr.write(f"expseg: {path} is missing: the package was installed without its tools\n")
        raise SystemExit(127)
    return path


def _env():
    env = dict(os.environ)
    if not env.get("EXPSEG_LIB"):
        try:
            env["EXPSEG_LIB"] = library_path()
        except FileNotFoundError as e:
            sys.stderr.write(f"expseg: {e}\n")
            raise SystemExit(127)
    return env


def _exec(argv):
    try:
        os.execve(argv[0], argv, _env())
    except OSError as e:
        sys.stderr.write(f"expseg: cannot run {argv[0]}: {e}\n")
        return 126


def _script(name, args):
    # Through bash (and Python): no reliance on the installed file's mode bits.
    return _exec(["/bin/bash", _tool(name)] + args) if name != "expseg-report-merge" else _exec(
        [sys.executable, _tool(name)] + args
    )


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "--lib":
        try:
            print(library_path())
        except FileNotFoundError as e:
            sys.stderr.write(f"expseg: {e}\n")
            return 1
        return 0
    if cmd == "--version":
        print(__version__)
        return 0
    if cmd == "run":
        return _script("expseg-run", rest)
    if cmd == "srun":
        return _script("expseg-srun", rest)
    if cmd == "report-merge":
        return _script("expseg-report-merge", rest)
    if cmd.startswith("-"):
        sys.stderr.write(f"expseg: unknown option {cmd}\n{USAGE}\n")
        return 2
    return _exec([_tool("expseg")] + args)


def run():
    return _script("expseg-run", sys.argv[1:])


def srun():
    return _script("expseg-srun", sys.argv[1:])


def report_merge():
    return _script("expseg-report-merge", sys.argv[1:])
